"""SIGINT and SIGTERM in the middle of an ``hdet-train`` run: every rank ends within 30 s,
one line says what happened and names the last checkpoint, the exit code is 128 + signum
(130, 143), no process is left behind, and the checkpoint resumes.

1. ``hdet-train`` (local launcher, 2 ranks = 2 replicas x 1 ZeRO-3 shard, W&B offline,
   so its service process must end too) gets SIGINT after its first periodic checkpoint.
   (2 ranks, not the default 4: what is checked here, the stop of every rank, the stop
   line, the resume's metrics and W&B run, the refusal of a damaged DeepSpeed file on
   every rank, does not depend on the shard count; each of the three DeepSpeed starts
   costs about half on 2 cores. The resume of 2 x 2 ZeRO-3 shards, bit-equal:
   test_resume.py.)
   Before that, a second ``hdet-train`` in the same run_dir is refused (exit 2, the
   run_dir lock names the running job) and changes nothing.
2. The same command with ``train.resume=true`` continues from that checkpoint, saves a
   later one, and gets SIGTERM. Its ``metrics.jsonl`` must read steps 1, 2, ... without a
   gap or a repeat: the resumed run dropped the records past the checkpoint and went on,
   and it logged into the first attempt's W&B run (the id its checkpoint recorded).
3. A real DeepSpeed ``*_model_states.pt`` of that checkpoint cut in half: the resume is
   refused before any rank starts, naming the file. The same file replaced by a complete
   archive of other content (damage no structure check sees): the load's check against
   the folder's manifest refuses it on every rank, and the launcher prints that one
   message naming the file, ends the ranks, and exits 2.
4. Under ``torchrun`` (which forwards the signal to every worker), SIGINT: rank 0 prints
   the one line, no rank prints a ``KeyboardInterrupt`` traceback (DDP backend, 2 ranks:
   the rank-side handler is the same for every engine, DDP starts fastest).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_processes import ENV, hostfile_standins, left_behind, processes_with, rank_processes, run_cli, with_marker

pytestmark = pytest.mark.timeout(600)

STOP_S = 30  # every rank gone within this many seconds of the signal
ARGS = ["train.steps=300", "train.checkpoint_every=3", "deepspeed.train_micro_batch_size_per_gpu=4",
        "train.eval_batches=4", "wandb.mode=offline", "train.progress=false", "train.plots=false"]
TRAIN = [sys.executable, "-m", "hdet_scale.train.cli"]


def latest(run_dir) -> str | None:
    try:
        return (run_dir / "checkpoint" / "latest").read_text().strip() or None
    except FileNotFoundError:
        return None


def _start_as_from_a_terminal(ignored: tuple = ()) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)


def interrupt(cmd: list[str], run_dir, sig: int, after: str | None, timeout: float = 300, meanwhile=None,
              group: bool = False, env: dict | None = None, ignored: tuple = ()):
    """Start ``cmd`` (``env``: added to the test environment), wait until
    ``checkpoint/latest`` names a checkpoint other than ``after``, call
    ``meanwhile(process)`` if given (the run still going), send ``sig`` to the started
    process (``group``: to its whole process group, as a closing terminal does). Returns
    ``(exit code, stderr, seconds from the signal until no process of the launch remains,
    left behind, checkpoint at the signal)``. The command starts with SIGINT and SIGHUP at
    their defaults, as under a terminal (``ignored``: these ignored instead): a test run
    started in the background (nohup, `cmd &` in a script) inherits them ignored, and bash
    cannot trap a signal ignored at entry, nor does hdet-train take one over."""
    env, tag = with_marker({**ENV, **(env or {})})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=group, preexec_fn=lambda: _start_as_from_a_terminal(ignored))
    try:
        deadline = time.monotonic() + timeout
        while latest(run_dir) in (None, after):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        seen = latest(run_dir)
        if meanwhile is not None:
            meanwhile(proc)
            assert proc.poll() is None, "the run ended before the signal"
        t0 = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=STOP_S + 30)
        while processes_with(tag) and time.monotonic() - t0 < STOP_S + 5:
            time.sleep(0.2)
        seconds = time.monotonic() - t0
    finally:
        leftovers = left_behind(tag, wait_s=0)  # also when an assertion above failed: nothing leaks
    return proc.returncode, err, seconds, leftovers, seen


def stop_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("hdet-train: stopped by")]


def steps_logged(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "hdet/loss" in r]


def test_sigint_and_sigterm_stop_every_rank_and_the_checkpoint_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [*TRAIN, f"run_dir={run_dir}", "nproc=2", *ARGS]

    # 1. SIGINT after the first periodic checkpoint; meanwhile a second job started in the
    # same run_dir (resuming what it finds) is refused by the run_dir lock, which names the
    # running launcher; that nothing was touched shows in part 2 (the metrics stay contiguous)
    second = {}

    def start_a_second_job(first):
        second["out"], second["first"] = run_cli([*cmd, "train.resume=true"]), first.pid

    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, signal.SIGINT, after=None, meanwhile=start_a_second_job)
    rc2, err2, seconds2, leftovers2 = second["out"]
    assert rc2 == 2 and f"run_dir: {run_dir} is in use by a running hdet-train (pid {second['first']} " in err2, (
        rc2, err2[-3000:])
    assert "Traceback" not in err2 and seconds2 < STOP_S and not leftovers2, (seconds2, leftovers2)
    tag = latest(run_dir)  # the newest complete checkpoint after the stop (a save cut short leaves it as it was)
    assert rc == 130, (rc, err[-3000:])
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and "SIGINT" in lines[0], err
    assert f"{run_dir}/checkpoint/replica_*/{tag}" in lines[0] and "train.resume=true" in lines[0], lines
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    first = int(tag.removeprefix("global_step"))

    # 2. resumed from it, SIGTERM after a later checkpoint
    rc, err, seconds, leftovers, _ = interrupt([*cmd, "train.resume=true"], run_dir, signal.SIGTERM, after=tag)
    tag2 = latest(run_dir)
    assert rc == 143, (rc, err[-3000:])
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and "SIGTERM" in lines[0] and f"replica_*/{tag2}" in lines[0], err
    assert "Traceback" not in err, err
    steps = steps_logged(run_dir)
    assert int(tag2.removeprefix("global_step")) > first
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > first, steps
    # the resumed attempt continued the first attempt's W&B run (the id its checkpoint
    # recorded, resume="allow"), not a new one: two offline folders, one run id
    folders = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and len({f.rsplit("-", 1)[1] for f in folders}) == 1, folders

    # 3. a real DeepSpeed model state file of that checkpoint cut in half
    victim = run_dir / "checkpoint" / "replica_1" / tag2 / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    rc, err, seconds, leftovers = run_cli([*cmd, "train.resume=true"])
    assert rc == 2 and str(victim) in err and "truncated" in err, (rc, err[-3000:])
    assert "Traceback" not in err and seconds < STOP_S and not leftovers, (seconds, leftovers)
    torch.save({"w": torch.zeros(3)}, victim)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    rc, err, seconds, leftovers = run_cli([*cmd, "train.resume=true"])
    # a resume that fails to load loses nothing: the metrics are trimmed only after the load
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    errors = [line for line in err.splitlines() if line.startswith("hdet-train: error:")]
    # the folder's manifest (backends/manifest.py) names the file before any engine reads it
    assert rc == 2 and len(errors) == 1 and f"{victim} (not the file this checkpoint saved there" in errors[0], (
        rc, err[-3000:])
    assert "Traceback" not in err and seconds < 60 and not leftovers, (seconds, leftovers)


def test_sigint_under_torchrun_one_line_from_rank_0(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hdet_scale.train.cli", f"run_dir={run_dir}", "backend=ddp", *ARGS]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, signal.SIGINT, after=None)
    assert rc != 0
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and "SIGINT" in lines[0] and f"replica_*/{latest(run_dir)}" in lines[0], err
    assert "KeyboardInterrupt" not in err, err


QUIET_TORCHRUN = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "torchrun_quiet.py")


@pytest.mark.parametrize("launcher", ["hdet-train", "torchrun"])
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path, launcher):
    """SIGKILL (or the OOM killer) to the launcher itself, which can forward nothing: the
    kernel ends its ranks (``prctl(PR_SET_PDEATHSIG)``), so none trains on unseen,
    holding the machine and writing into a run_dir that a restart would reuse. Under
    torchrun (the launchers' torchrun_quiet.py) a kill -9 of the agent does not leave
    both ranks training, orphaned, holding the run_dir lock: they stop, rank 0 saying why
    and where the checkpoint is, and the run resumes from it."""
    run_dir = tmp_path / "run"
    start = ([sys.executable, QUIET_TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "hdet_scale.train.cli"]
             if launcher == "torchrun" else [*TRAIN, "nproc=2"])
    rc, err, seconds, leftovers, _ = interrupt([*start, f"run_dir={run_dir}", "backend=ddp", *ARGS], run_dir,
                                               signal.SIGKILL, after=None)
    assert rc == -signal.SIGKILL
    assert seconds < STOP_S and not leftovers, (seconds, leftovers, err[-3000:])
    # no multiprocessing "resource_tracker: There appear to be 2 leaked semaphore objects"
    # warning (the launcher has one pipe per rank, no SimpleQueue)
    assert "Warning" not in err and "leaked" not in err, err[-3000:]
    if launcher == "torchrun":
        gone = [line for line in err.splitlines() if "is gone without stopping the ranks" in line]
        assert len(gone) == 1 and f"Last checkpoint: {run_dir}/checkpoint/replica_*/" in gone[0], err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    # the run_dir is free again (no rank holds its lock) and its checkpoint continues: the
    # resumed run saves a newer one (then it is stopped)
    tag = latest(run_dir)
    rc, err, _, leftovers, _ = interrupt([*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", *ARGS,
                                          "train.resume=true"], run_dir, signal.SIGTERM, after=tag)
    assert rc == 143 and not leftovers, (rc, leftovers, err[-3000:])
    assert int(latest(run_dir).removeprefix("global_step")) > int(tag.removeprefix("global_step"))


def test_sighup_to_the_launcher_stops_like_sigterm(tmp_path):
    """SIGHUP (the terminal closed) stops the run as SIGTERM does: one line naming the
    signal and the last checkpoint, exit 128 + 1, nothing left behind (DDP, 2 ranks),
    not the ranks ended and no line from the launcher (exit 129 with a semaphore warning
    only). Sent to the whole process group, as a closing terminal does:
    multiprocessing's resource tracker must not die of it after the clean stop, with
    KeyError tracebacks."""
    run_dir = tmp_path / "run"
    cmd = [*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", *ARGS]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, signal.SIGHUP, after=None, group=True)
    assert rc == 128 + signal.SIGHUP, (rc, err[-3000:])
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and "SIGHUP" in lines[0] and f"replica_*/{latest(run_dir)}" in lines[0], err
    assert "Traceback" not in err and "resource_tracker" not in err, err


def test_under_nohup_a_closing_terminal_does_not_stop_the_run(tmp_path):
    """``nohup hdet-train &``: SIGHUP is ignored from the start, so a closing terminal must
    not stop the run (the launcher took SIGHUP over and stopped it with exit 129). The run
    gets SIGHUP in its whole process group after its first checkpoint and ends as an
    uninterrupted run does: exit 0, no stop line, every step logged, summary.json written
    (DDP, 2 ranks, 30 steps)."""
    run_dir = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("train.steps=")]
    cmd = [*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", *args, "train.steps=30"]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, signal.SIGHUP, after=None, group=True,
                                               ignored=(signal.SIGHUP,))
    assert rc == 0 and not stop_lines(err) and not leftovers, (rc, err[-3000:], leftovers)
    assert steps_logged(run_dir) == list(range(1, 31)) and (run_dir / "summary.json").exists()


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_a_signal_ends_a_rendezvous_whose_peers_never_come(tmp_path, backend):
    """With the launcher variables set and no peer ever joining (a stray RANK /
    WORLD_SIZE, a wrong MASTER_ADDR), the rank waits in torch's TCPStore rendezvous for
    30 minutes, its main thread in C++ where Python handlers never run, so SIGINT /
    SIGTERM / ``timeout`` would do nothing and only kill -9 end it. Rank 0 of 2 alone
    here: once its store listens on MASTER_PORT it is in the rendezvous; a SIGTERM then
    ends it within seconds (the default action: exit by SIGTERM), leaving nothing."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, tag = with_marker({**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cmd = [*TRAIN, f"run_dir={tmp_path / 'run'}", f"backend={backend}", "train.steps=10", "wandb.enabled=false",
           "train.progress=false", "train.plots=false", "deepspeed.hdet.auto.enabled=false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:  # rank 0's TCPStore server: up once it waits for the peer
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 0 never reached the rendezvous"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        time.sleep(1.0)  # inside init_process_group's wait, past the store's creation
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"SIGTERM did not end the rendezvous within 15 s: {err[-2000:]}")
        seconds = time.monotonic() - t0
    finally:
        leftovers = left_behind(tag)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), (proc.returncode, err[-3000:])
    assert seconds < 10 and not leftovers, (seconds, leftovers)
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("sig,to", [(signal.SIGINT, "group"), (signal.SIGTERM, "script")])
def test_deepspeed_hostfile_script_stops_on_a_signal_without_a_restart(tmp_path, sig, to):
    """Ctrl-C (SIGINT to the terminal's process group) to ``launchers/deepspeed_hostfile.sh``
    must not restart the run with train.resume=true, nor a SIGTERM to the script alone (a
    scheduler's, ``kill PID``) end the script and leave the training running. Either stops
    the run once: exit 130 / 143, the trainer's stop line, no restart, nothing left behind
    (the deepspeed launcher replaced by a stand-in that runs the same module on this host: no
    sshd or pdsh here; DDP, 2 ranks)."""
    run_dir = tmp_path / "run"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "deepspeed_hostfile.sh")
    cmd = ["bash", script, f"run_dir={run_dir}", "nproc=2", "backend=ddp", *ARGS]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, sig, after=None, group=to == "group",
                                               env={**hostfile_standins(tmp_path), "MAX_RESTARTS": "2"})
    assert rc == 128 + sig, (rc, err[-3000:])
    assert "restart" not in err and len((tmp_path / "bin" / "calls").read_text().splitlines()) == 1, err[-3000:]
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and sig.name in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_signal_after_the_ranks_ended_leaves_the_completed_runs_exit_code(tmp_path):
    """A SIGINT that reaches the launcher after its ranks have ended (the run complete,
    summary.json written) must not exit 130 without a line (Python's teardown puts SIGINT
    back to its default action) or, a moment earlier, with a KeyboardInterrupt traceback.
    The launcher's outcome is decided then: SIGINT and SIGTERM are sent every 10 ms from
    0.3 s after the last rank is gone (the launcher's teardown lasts 0.5-0.8 s more here,
    measured) until the launcher exits, which must exit 0 (as without the signals)
    without a traceback or a stop line (DDP, 2 ranks)."""
    import psutil

    run_dir = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith(("train.steps=", "wandb."))]
    cmd = [*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", *args, "train.steps=30", "wandb.enabled=false"]
    env, tag = with_marker(ENV)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    sent = 0
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        while not (run_dir / "summary.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.01)
        # the ranks gone: what is left is the launcher's own ending
        while rank_processes(launcher.pid):
            time.sleep(0.005)
        time.sleep(0.3)  # past the launcher's next look at its ranks (every 0.2 s): its loop has ended
        while proc.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                    sent += 1
            time.sleep(0.01)
        out, err = proc.communicate(timeout=30)
    finally:
        leftovers = left_behind(tag)
    assert proc.returncode == 0 and sent > 0, (proc.returncode, sent, err[-3000:])
    assert "Traceback" not in err and not stop_lines(err), err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30 and not leftovers


def test_a_rank_killed_after_the_run_completed_is_not_a_failed_run(tmp_path):
    """Rank 1 killed with SIGKILL while rank 0 writes the end-of-run plots (summary.json
    and the final checkpoint written, rank 1 at the last barrier) is no failed run: exit
    0, one line naming the rank and that the run completed, no resume advice (which a
    resume would refuse: nothing is left to do); the summary is the full run's (DDP, 2
    ranks, 30 steps, plots on: rank 0 plots for seconds, rank 1 waits)."""
    import psutil

    run_dir = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith(("train.steps=", "wandb.", "train.plots="))]
    cmd = [*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", *args, "train.steps=30", "wandb.enabled=false",
           "train.plots=true"]
    env, tag = with_marker(ENV)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "summary.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.01)
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 2 and ranks[1].is_running(), ranks  # rank 1 (started second) waits at the barrier
        ranks[1].kill()
        _, err = proc.communicate(timeout=60)
    finally:
        leftovers = left_behind(tag)
    assert proc.returncode == 0 and not leftovers, (proc.returncode, err[-3000:], leftovers)
    lines = [line for line in err.splitlines() if "after the run completed" in line]
    assert len(lines) == 1 and lines[0].startswith("hdet-train: rank(s) [1] killed by SIGKILL (signal 9)"), err[-3000:]
    assert "resume=true" not in err and "failed" not in err and "Traceback" not in err, err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30


@pytest.mark.parametrize("script,sig,to", [("torchrun_single_node.sh", signal.SIGINT, "group"),
                                           ("torchrun_single_node.sh", signal.SIGTERM, "script"),
                                           ("torchrun_single_node.sh", signal.SIGKILL, "script"),
                                           ("torchrun_multi_node.sh", signal.SIGHUP, "group")],
                         ids=["single-node-SIGINT-to-group", "single-node-SIGTERM-to-script",
                              "single-node-SIGKILL-to-script", "multi-node-SIGHUP-to-group"])
def test_torchrun_scripts_stop_on_a_signal_with_one_line_and_no_restart(tmp_path, script, sig, to):
    """Ctrl-C (SIGINT to the terminal's process group) or a SIGTERM to
    ``launchers/torchrun_single_node.sh`` exits 130 / 143 / 129 with the one stop line, no
    torchrun ``SignalException`` traceback after it, and no exit 1; torchrun gets the
    signal itself (else it counts the ranks' stop as a failure and restarts them,
    MAX_RESTARTS=2 here): no rank's exit is a failure to it and the metrics go on from
    step 1 once; nothing left behind (DDP, 2 ranks). ``torchrun_multi_node.sh`` (one node
    here) starts torchrun the same way."""
    import socket

    run_dir = tmp_path / "run"
    path = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", script)
    env = {"GPUS": "2", "MAX_RESTARTS": "2"}
    if script == "torchrun_multi_node.sh":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(NNODES="1", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = ["bash", path, f"run_dir={run_dir}", "backend=ddp", *ARGS]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, sig, after=None, group=to == "group", env=env)
    assert rc == (-sig if sig == signal.SIGKILL else 128 + sig), (rc, err[-3000:])
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    # a kill -9 of the script must not leave torchrun and its ranks training, detached:
    # torchrun gets a SIGTERM when the script dies, and says why
    said = "SIGTERM" if sig == signal.SIGKILL else sig.name
    assert len(lines) == 1 and said in lines[0] and f"replica_*/{latest(run_dir)}" in lines[0], err[-3000:]
    assert (sig != signal.SIGKILL) == ("its launcher script (process" not in err), err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    # torchrun's agent's warnings on ending the ranks repeated the stop line three times
    assert "death signal" not in err and "closing signal" not in err, err[-3000:]
    # what torchrun logs for a rank's exit it counts as a failure, before it restarts them
    assert "failed (exitcode" not in err, err[-3000:]
    steps = steps_logged(run_dir)
    assert steps == list(range(1, len(steps) + 1)), steps


def test_a_stop_during_a_rendezvous_that_gets_no_answer_ends_the_multi_node_script_at_once(tmp_path):
    """Node 1 of ``torchrun_multi_node.sh`` whose MASTER_ADDR does not answer says it
    waits for the rendezvous, and a stop with no rank started ends torchrun within about
    10 s, one line, exit 143, nothing left (torchrun blocked in its store's connect, in
    C++, sees no signal: a SIGTERM would end it only 47 s later, measured). The
    rendezvous endpoint here is a socket that accepts connections and never answers."""
    import socket

    path = os.path.join(os.path.dirname(__file__), "..", "..", "launchers", "torchrun_multi_node.sh")
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        port = mute.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GPUS": "2", "NNODES": "2", "NODE_RANK": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        proc = subprocess.Popen(["bash", path, f"run_dir={tmp_path / 'run'}", "backend=ddp", *ARGS],
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        first = proc.stderr.readline()
        assert (f"node 1 of 2: torchrun starts 2 rank(s) here once all 2 nodes have joined the rendezvous at "
                f"127.0.0.1:{port}") in first, first
        time.sleep(8)  # torchrun is in its connect attempts (60 s of retries)
        assert proc.poll() is None
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        err = proc.stderr.read()
        proc.wait(timeout=60)
        seconds = time.monotonic() - start
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    # 10 s of grace for torchrun's own stop, then the SIGKILL (a loaded machine: 20 s)
    assert seconds < 20, seconds
    assert "torchrun had started no rank 10 s after the SIGTERM (still in its rendezvous): ended at once" in err, \
        err[-3000:]
    assert "Killed" not in err, err[-3000:]
    out = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not out.strip(), out


def test_scancel_of_the_slurm_script_stops_with_one_line_and_no_traceback(tmp_path):
    """scancel (SIGTERM to every process of the job) puts no torchrun ``SignalException``
    traceback into the job's output after the trainer's stop line:
    ``launchers/slurm.sbatch`` runs torchrun through ``torchrun_quiet.py``: the one stop
    line, no traceback, no restart (MAX_RESTARTS=2), nothing left behind. SLURM is absent
    here: ``scontrol`` and ``srun`` are stand-ins (one node, this host; srun runs its
    command), and the signal goes to the job's whole process group as scancel's does (DDP,
    2 ranks). The batch shell itself dies of the SIGTERM (it sets no trap; SLURM reads the
    tasks' ends), so its exit code is -15 or 143."""
    import socket

    run_dir, bin_dir = tmp_path / "run", tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", "#!/bin/sh\necho localhost\n"),
                       ("srun", '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(port), "GPUS_PER_NODE": "2", "MAX_RESTARTS": "2",
           "MASTER_PORT": str(port), "HDET_REPO_DIR": repo}
    cmd = ["bash", os.path.join(repo, "launchers", "slurm.sbatch"), f"run_dir={run_dir}", "backend=ddp", *ARGS]
    rc, err, seconds, leftovers, _ = interrupt(cmd, run_dir, signal.SIGTERM, after=None, group=True, env=env)
    assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), (rc, err[-3000:])
    assert seconds < STOP_S and not leftovers, (seconds, leftovers)
    lines = stop_lines(err)
    assert len(lines) == 1 and "SIGTERM" in lines[0], err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "closing signal" not in err, err[-3000:]
    assert "failed (exitcode" not in err, err[-3000:]  # torchrun counted no rank's stop as a failure
    steps = steps_logged(run_dir)
    assert steps == list(range(1, len(steps) + 1)), steps


def test_a_note_from_the_checks_is_printed_once_not_by_every_rank(tmp_path):
    """The note on a validation split read on overlapping windows comes once, as the
    hdet-train line (DDP, 2 ranks, 10 steps), not once more from every rank as a raw
    Python warning (file, line and source). No other UserWarning either (with auto-LR
    off, no rank warns of hdet-train's own probe, which nothing calls)."""
    run_dir = tmp_path / "run"
    rc, err, _, leftovers = run_cli([*TRAIN, f"run_dir={run_dir}", "backend=ddp", "nproc=2", "train.steps=10",
                                     "data.max_bytes=40000", "wandb.enabled=false", "train.progress=false",
                                     "train.plots=false", "deepspeed.hdet.auto.enabled=false"], timeout=300)
    assert rc == 0 and not leftovers, (rc, err[-3000:])
    said = [line for line in err.splitlines() if "the validation loss reads" in line]
    assert len(said) == 1 and said[0].startswith("hdet-train: warning: hdet_scale: train.eval_batches=16"), err[-3000:]
    assert "UserWarning" not in err, err[-3000:]
