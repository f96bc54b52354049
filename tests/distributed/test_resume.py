"""Checkpoints during an ``hdet-train`` run, one rank killed with SIGKILL, and the resume,
compared with an uninterrupted run of the same config (4 CPU ranks = 2 replicas x 2 shards).

The run: 8 optimizer steps, a sync every 3 (at 3 and 6, auto-LR scoring both; the final
converge at 8), a checkpoint every 3 (at 3 and 6: on sync steps, saved right after
converge; the final one at 8), the newest 2 kept, attention dropout 0.1 (so the per-rank
RNG must be restored). Rank 3 kills itself right after step 7 (``HDET_FAULT_KILL``, the
trainer's fault-injection hook): mid-interval, after the step-6 checkpoint. The resumed
run continues from step 6, a sync step. (The run is short for the suite's time; every
state the resume must restore is exercised.)

What "as if uninterrupted" is held to: the LR trace (every ``hdet/lr/*`` value of every
step and sync record), the losses of every step, the interval losses and probe fitness of
both syncs, and the final validation loss, all bit-equal: the same float operations in the
same order (data keyed by the step; optimizer, HDET and RNG state restored), measured bit-
equal on DeepSpeed and FSDP2. No slack: the state a checkpoint can miss shows in the last
bits first. Measured on a 12-step version of this run: with DeepSpeed's CPU Adam keeping
beta**t outside the checkpoint (what ``backends/ds_adam.py`` prevents) the resume would
differ from the step after it on by ~1e-7 relative, which a 1e-6 bound would let pass.
Without the RNG restore the losses would part by up to 8.5e-5 (relative) and val_loss by
1.1e-5 (measured with checkpoints at 4 and 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(600)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
SHORT = ["train.steps=8", "train.checkpoint_every=3", "train.keep_checkpoints=2", "deepspeed.hdet.sync_interval=3",
         "deepspeed.hdet.auto.warmup_steps=3", "train.eval_batches=4", "model.dropout=0.1", "wandb.enabled=false",
         "train.progress=false", "train.plots=false"]
KILL = {"HDET_FAULT_KILL": "3:7"}  # global rank 3, right after optimizer step 7
LOSSES = ("hdet/loss", "hdet/loss/replica_0", "hdet/loss/replica_1", "hdet/fitness/replica_0", "hdet/fitness/replica_1")


def hdet_train(args: list[str], env: dict | None = None, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # a launcher: a module (-m torch.distributed.run ...) or a script path (launchers/torchrun_quiet.py ...)
    start = ([launcher[0]] if launcher[0].endswith(".py") else ["-m", launcher[0]]) if launcher else []
    cmd = [sys.executable, *start, *launcher[1:], "-m", "hdet_scale.train.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=450, env={**ENV, **(env or {})})


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without a kill, once per backend: ``(records, summary)``."""
    runs = {}

    def get(backend: str):
        if backend not in runs:
            run_dir = tmp_path_factory.mktemp(f"uninterrupted_{backend}") / "run"
            proc = hdet_train([f"run_dir={run_dir}", f"backend={backend}", *SHORT])
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[backend] = records(run_dir), json.loads((run_dir / "summary.json").read_text())
        return runs[backend]

    return get


def assert_same_run(run_dir, reference, resumed_from: int = 6) -> None:
    want, want_summary = reference
    got = records(run_dir)
    # every step once: the dead run's records after its checkpoint were dropped
    assert [(r["step"], "hdet/sync" in r) for r in got] == [(r["step"], "hdet/sync" in r) for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), (g["step"], set(g) ^ set(w))
        lr = sorted(k for k in w if k.startswith("hdet/lr/"))
        assert lr and [g[k] for k in lr] == [w[k] for k in lr], f"step {w['step']}: LR trace differs"
        for k in LOSSES:
            if k in w:
                assert g[k] == w[k], (w["step"], k, g[k], w[k])
        if "hdet/sync" in w:
            assert (g["hdet/step"], g["hdet/sync"]) == (w["hdet/step"], w["hdet/sync"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] == want_summary["val_loss"]
    assert summary["steps"] == 8 and summary["resumed_from_step"] == resumed_from


def test_a_run_in_two_parts_of_one_schedule_ends_as_the_uninterrupted_run(tmp_path, uninterrupted):
    """``train.steps=5`` of ``schedule.total_steps=8`` (step 5 no sync step, a checkpoint at
    3 and at the end), then ``train.resume=true`` with ``train.steps=8``, equals the
    uninterrupted run bit for bit (every LR, loss and sync record, and the final val_loss):
    the first part saved each replica before averaging them for its own evaluation (logged
    as ``hdet/final_converge`` at step 5, without a sync, and dropped by the resume). Were
    the average to come first, every later step would differ."""
    run_dir = tmp_path / "run"
    first = [a for a in SHORT if not a.startswith("train.steps=")]
    # FSDP2 (its uninterrupted run is shared with the restart tests; the loop is the same
    # code on every engine, and DeepSpeed's starts cost ~20 s each)
    proc = hdet_train([f"run_dir={run_dir}", "backend=fsdp2", *first, "train.steps=5",
                       "deepspeed.hdet.schedule.total_steps=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    end = [r for r in records(run_dir) if r.get("hdet/final_converge")]
    assert [(r["step"], "hdet/sync" in r) for r in end] == [(5, False)], end
    # the averaged model val_loss measured is in no file: said
    assert ("hdet-train: note: train.steps=5 < deepspeed.hdet.schedule.total_steps=8: the checkpoint holds each "
            "replica's own weights") in proc.stderr, proc.stderr[-3000:]
    proc = hdet_train([f"run_dir={run_dir}", "backend=fsdp2", *SHORT, "train.resume=true",
                       "deepspeed.hdet.schedule.total_steps=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted("fsdp2"), resumed_from=5)


def test_a_rank_killed_mid_interval_resumes_as_if_uninterrupted(tmp_path, uninterrupted):
    """DeepSpeed ZeRO-3 under hdet-train's own launcher: the killed rank makes the launcher
    stop the others and exit 1 with ``latest`` at the step-6 checkpoint; a crash while
    saving (simulated: a partial step-8 folder, a torn metrics line) poisons nothing;
    ``train.resume=true`` finishes the run; the newest 2 checkpoints are kept."""
    run_dir = tmp_path / "run"
    proc = hdet_train([f"run_dir={run_dir}", *SHORT], env=KILL)
    assert proc.returncode == 1 and "rank(s) [3] killed by SIGKILL (signal 9)" in proc.stderr, proc.stderr[-3000:]
    # the failure line names the checkpoint to resume from, and the ranks
    # that lost their peer print no gloo traceback each
    assert (f"Last checkpoint: {run_dir}/checkpoint/replica_*/global_step6 (step 6); continue with "
            "train.resume=true") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ckpt = run_dir / "checkpoint"
    assert (ckpt / "latest").read_text() == "global_step6"
    assert json.loads((ckpt / "hdet_layout.json").read_text())["checkpoints"] == {"global_step3": 3, "global_step6": 6}
    assert 7 in [r["step"] for r in records(run_dir)]  # the dead run went on past its checkpoint
    stale = ckpt / "replica_1" / "global_step8" / "stale.bin"  # what a crash during the step-8 save leaves
    stale.parent.mkdir()
    stale.write_bytes(b"partial")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "hdet/lo')

    # A resume with another model shape: refused by the launcher from the settings the real
    # saves recorded, in seconds, before any rank starts; the stopped run is left as it was.
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    t0 = time.monotonic()
    proc = hdet_train([f"run_dir={run_dir}", *SHORT, "train.resume=true", "model.hidden_size=64"])
    assert proc.returncode == 2 and "model.hidden_size: 128 -> 64" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 30, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before

    # Changed settings that the warning says the resumed run does not take from this run
    # (the optimizer's groups come back with its state; the permutation generator's state
    # too; warm init only acts at step 0): the run must still equal the uninterrupted one.
    kept = ["deepspeed.optimizer.params.betas=[0.8,0.99]", "deepspeed.optimizer.params.eps=1e-6",
            "deepspeed.optimizer.params.weight_decay=0.3", "deepspeed.hdet.seed=7", "deepspeed.hdet.warm_init.nu=0.5"]
    proc = hdet_train([f"run_dir={run_dir}", *SHORT, "train.resume=true", *kept])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted("deepspeed"))
    warning = proc.stderr.split("hdet-train: warning: train.resume:", 1)[1]
    for words in ("betas: [0.9, 0.95] -> [0.8, 0.99]: the resumed run keeps the checkpoint's value [0.9, 0.95]",
                  "eps: 1e-08 -> 1e-06: the resumed run keeps the checkpoint's value 1e-08",
                  "weight_decay: 0.1 -> 0.3: the resumed run keeps the checkpoint's value 0.1",
                  "deepspeed.hdet.seed: 0 -> 7: the resumed run keeps the checkpoint's value 0",
                  "deepspeed.hdet.warm_init.nu: 0.01 -> 0.5: no effect on a resumed run"):
        assert words in warning, (words, warning)
    assert not stale.exists()
    for r in range(2):
        assert sorted(p.name for p in (ckpt / f"replica_{r}").iterdir() if p.is_dir()) == ["global_step6", "global_step8"]


def test_a_crash_with_no_restarts_left_names_the_checkpoint_without_a_traceback(tmp_path):
    """Through the launchers' torchrun with no restarts left, a killed rank exits 1
    (torchrun's code for a failure) with one line of the launcher naming the killed rank,
    rank 0's naming the failure and the checkpoint, no traceback (torchrun's
    ChildFailedError), no agent lines, no marker left, and no "stopped by SIGTERM" from
    rank 0 (the agent's, after the kill)."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    quiet = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "torchrun_quiet.py")
    proc = hdet_train([f"run_dir={run_dir}", "backend=ddp", *SHORT],
                      launcher=(quiet, "--standalone", "--nproc_per_node=4", "--max-restarts=0"),
                      env={**KILL, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(tmp)})
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    for absent in ("Traceback", "stopped by SIGTERM", "closing signal", "exitcode"):
        assert absent not in err, (absent, err[-3000:])
    assert ("hdet-train: torchrun: failed: rank(s) [3] killed by SIGKILL (signal 9); a rank killed by SIGKILL is "
            "often the out-of-memory killer's work (see dmesg), or a kill -9; no restarts left (--max-restarts=0): "
            "torchrun ends the other ranks and exits 1.") in err, err[-3000:]
    # rank 0's line: the agent's SIGTERM (which names the failure) or gloo's lost peer first
    assert f"Last checkpoint: {run_dir}/checkpoint/replica_*/global_step6 (step 6); continue with train.resume=true" \
        in err, err[-3000:]
    ended = [line for line in err.splitlines() if line.startswith("hdet-train: torchrun ended every rank")]
    assert all("after a failure (rank(s) [3] killed by SIGKILL (signal 9))." in line for line in ended), ended
    assert not [p for p in tmp.rglob("*") if p.is_file()]  # the failure note is the agent's to remove


def _rank_pid(agent: int, rank: int) -> int | None:
    """The process id of global rank ``rank`` among the children of ``agent`` (its environ's RANK)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


def _when_the_summary_appears(run_dir, tmp, act) -> tuple[subprocess.Popen, str, bool]:
    """The launchers' torchrun (torchrun_quiet.py, 2 DDP ranks, one restart allowed, the
    end-of-run plots on, in a session of its own) running :data:`SHORT` into ``run_dir``
    with ``TMPDIR=tmp``; ``act(proc)`` is called as soon as summary.json appears, until it
    returns True. Returns ``(proc, stderr, whether act succeeded)`` once the job ended."""
    tmp.mkdir()
    quiet = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "torchrun_quiet.py")
    args = [f"run_dir={run_dir}", "backend=ddp", *[a for a in SHORT if a != "train.plots=false"], "train.plots=true"]
    cmd = [sys.executable, quiet, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m",
           "hdet_scale.train.cli", *args]
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(tmp)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    acted = False
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        if (run_dir / "summary.json").exists() and act(proc):
            acted = True
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    return proc, err, acted


def test_a_rank_lost_after_the_run_completed_is_no_failed_run_under_torchrun(tmp_path):
    """After a torchrun restart the run completes (summary.json, plots) and a rank may then
    die in its exit (SIGABRT in the interpreter's teardown), which the launchers' torchrun
    would report as a failed run with no restarts left, exit 1. Ranks skip that teardown
    (``stopping.exit_completed``), and a rank lost after rank 0 wrote summary.json is
    reported once as after the run completed: exit 0, no restart although one is left, no
    "failed" line, no traceback, no marker left. Rank 1 is killed as soon as summary.json
    appears, while rank 0 writes the plots (or, if rank 0 is already in the last barrier,
    it loses its peer there): either path must end the same way."""
    import signal

    def kill_rank_1(proc) -> bool:
        if (pid := _rank_pid(proc.pid, 1)) is None:
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    proc, err, killed = _when_the_summary_appears(run_dir, tmp, kill_rank_1)
    assert killed, err[-3000:]  # rank 1 was still there when summary.json appeared (the last barrier)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if "after the run completed" in line]
    assert len(lines) == 1 and f"({run_dir}/summary.json written, final checkpoint saved): nothing is lost" \
        in lines[0], err[-3000:]
    assert lines[0].startswith(("hdet-train: rank(s) [1] killed by SIGKILL (signal 9) after",
                                "hdet-train: torchrun: rank(s) [1] killed by SIGKILL (signal 9) after",
                                "hdet-train: rank 0 lost the connection to a rank that ended")), lines
    for absent in ("Traceback", "failed:", "restarts the job", "stopped by SIGTERM", "torchrun restart 1"):
        assert absent not in err, (absent, err[-3000:])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    assert not [p for p in tmp.rglob("*") if p.is_file() and "hdet-train-refusals" in str(p)]


def test_a_stop_after_the_run_completed_exits_0_under_torchrun(tmp_path):
    """A SIGTERM to the launchers' torchrun while rank 0 writes the end-of-run plots
    (summary.json written) exits 0, as hdet-train's own launcher does then, since rank
    0's line says the run completed (not 143). The signal goes to torchrun's process
    group, as torchrun_stop.sh sends it, once summary.json appears: exit 0, one line, no
    stop line naming a resume, the summary of all 8 steps."""
    import signal

    def stop_the_group(proc) -> bool:
        os.killpg(proc.pid, signal.SIGTERM)
        return True

    run_dir = tmp_path / "run"
    proc, err, stopped = _when_the_summary_appears(run_dir, tmp_path / "tmp", stop_the_group)
    assert stopped, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    assert len([line for line in err.splitlines() if "after the run completed" in line]) == 1, err[-3000:]
    for absent in ("Traceback", "train.resume=true", "restarts the job"):
        assert absent not in err, (absent, err[-3000:])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8


def test_torchrun_restarts_the_job_and_it_resumes_by_itself(tmp_path, uninterrupted):
    """FSDP2 under ``torchrun --max-restarts=1``, started as launchers/ start it (through
    launchers/torchrun_quiet.py, which restarts no refusal: a crash must still be
    restarted): the kill fails the first attempt, torchrun restarts every rank
    (``TORCHELASTIC_RESTART_COUNT=1``, where the fault hook stays quiet), and the trainer
    resumes from the step-6 checkpoint without ``train.resume``: the job exits 0 with the
    uninterrupted run's result.
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in the launchers: with torch's shared
    rendezvous store a restarted gloo world reads the dead attempt's addresses (pytorch
    issue 135712) and cannot connect."""
    run_dir = tmp_path / "run"
    quiet = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "torchrun_quiet.py")
    launcher = (quiet, "--standalone", "--nproc_per_node=4", "--max-restarts=1")
    proc = hdet_train([f"run_dir={run_dir}", "backend=fsdp2", *SHORT], launcher=launcher,
                      env={**KILL, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the first attempt did die, and the launcher's one line says so and what comes next
    assert ("hdet-train: torchrun: failed: rank(s) [3] killed by SIGKILL (signal 9)" in proc.stderr
            and "torchrun ends the other ranks and restarts the job (restart 1 of 1)" in proc.stderr), proc.stderr[-3000:]
    # and the restart says what it does (not only in summary.json's resumed_from_step)
    assert (f"hdet-train: torchrun restart 1: resuming from the newest checkpoint, "
            f"{run_dir}/checkpoint/replica_*/global_step6") in proc.stderr, proc.stderr[-3000:]
    # rank 0's line, if the agent's SIGTERM came first, names the failure and the restart
    # (not "stopped by SIGTERM", as if the user had sent it)
    assert "stopped by SIGTERM" not in proc.stderr, proc.stderr[-3000:]
    ended = [line for line in proc.stderr.splitlines() if line.startswith("hdet-train: torchrun ended every rank")]
    assert all(f"It restarts the job (restart 1 of 1), which resumes from {run_dir}/checkpoint/replica_*/global_step6 "
               "(step 6) by itself." in line for line in ended), ended
    # a rank that outlives the dead one prints one line, not gloo's connection-reset
    # traceback, when it happens (torchrun's own SIGTERM may come first)
    assert not ("Traceback" in proc.stderr and "Connection reset by peer" in proc.stderr), proc.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted("fsdp2"))


def test_deepspeed_hostfile_script_restarts_and_resumes_with_the_users_own_train_resume(tmp_path, uninterrupted):
    """``launchers/deepspeed_hostfile.sh`` reruns a failed job with ``train.resume=true``
    (the deepspeed launcher has no restart of its own). Given a user's own
    ``train.resume=true`` (what a job submitted again and again carries) the rerun must not
    pass it twice (it would be refused). The first attempt dies (rank 3 after step 7, as
    above); the script's restart must replace the user's value, resume from step 6, exit 0,
    and end as the uninterrupted run, bit-equal (the deepspeed launcher replaced by a
    stand-in that runs the same module: no sshd or pdsh here; FSDP2, already run
    uninterrupted above)."""
    from cli_processes import hostfile_standins

    run_dir = tmp_path / "run"
    env = {**ENV, **hostfile_standins(tmp_path), **KILL}
    script = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "deepspeed_hostfile.sh")
    proc = subprocess.run(["bash", script, f"run_dir={run_dir}", "backend=fsdp2", *SHORT, "train.resume=true"],
                          capture_output=True, text=True, timeout=450, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1/3 with train.resume=true" in proc.stderr, proc.stderr[-3000:]
    calls = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert len(calls) == 2 and [c.split().count("train.resume=true") for c in calls] == [1, 1], calls
    assert_same_run(run_dir, uninterrupted("fsdp2"))
