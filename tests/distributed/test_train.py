"""``hdet-train`` end to end, and bad input exiting fast on every rank.

The end-to-end run is the real trainer (4 local ranks = 2 replicas x 2 ZeRO-3
shards, CPU, gloo) on the default corpus, shortened to 40 steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from harness import run_ranks
from train_workers import cli_rank

pytestmark = pytest.mark.timeout(600)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
# micro-batch 4 x 2 accumulation steps: the schedule, syncs and logs count optimizer steps.
SHORT = ["train.steps=40", "deepspeed.train_micro_batch_size_per_gpu=4", "deepspeed.gradient_accumulation_steps=2", "deepspeed.hdet.sync_interval=10", "deepspeed.hdet.auto.warmup_steps=20",
         "train.eval_batches=8", "wandb.mode=offline", "train.progress=false", "train.plots=false"]


def hdet_train(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hdet_scale.train.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_default_job_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots" / "sync.png").write_bytes(b"an earlier run's plot")  # replaced, not kept
    # recorded as an earlier run's in this run_dir (a user's own file of that name: refused
    # before the start, tests/unit/test_checkpoint_files.py)
    (run_dir / "plots" / ".hdet_plots.json").write_text(
        json.dumps({"metrics": os.path.realpath(run_dir / "metrics.jsonl"), "pngs": ["sync.png"]}))
    (run_dir / "plots" / "mine.txt").write_text("the user's")  # not ours: stays
    proc = hdet_train([f"run_dir={run_dir}", *SHORT[:-1], "train.plots=true"], timeout=400)
    check_run(run_dir, proc, "deepspeed")
    # hdet-train wrote the plots (hdet_scale/plot.py; their numbers: tests/unit/test_plot.py)
    written = sorted(p.name for p in (run_dir / "plots").iterdir())
    assert {"fanout_lr_group0.png", "base_lr_group0.png", "sync.png", "loss.png", "mine.txt"} <= set(written), written
    assert (run_dir / "plots" / "sync.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4 plots in" in proc.stderr or "plots in" in proc.stderr, proc.stderr[-2000:]
    check_zero_to_fp32(run_dir / "checkpoint")


def check_zero_to_fp32(ckpt) -> None:
    """DeepSpeed's own consolidation (``zero_to_fp32``, what a user runs on a replica's
    folder) gives every replica the same parameter names, the tied LM head included, as
    one tensor with the embedding. DeepSpeed records the tied names on global rank 0 only:
    without ds_shared, replica_1's state dict would lack ``lm_head.weight``.
    The replicas' values are compared nowhere here: they differ between syncs."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    names = []
    for r in range(2):
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / f"replica_{r}"))
        assert "lm_head.weight" in sd, (r, sorted(sd))
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]), r
        names.append(sorted(sd))
    assert names[0] == names[1]


# The same job on FSDP2 (the other sharded engine), shorter (20 steps, syncs at 10 and 20):
# the loop, logging, summary and checkpoint are the same code on every engine (one Engine
# over hdet_scale.prepare); what differs is the engine. DDP and fairscale run hdet-train's
# loop in test_accumulation (accumulation 2 vs 1, on every backend), the README loop in
# test_api (the four engines held to each other and resumed), and their probe fitness,
# LRs and converge against the Simulator in test_agreement: a third and fourth copy of
# this end-to-end run (~32 s of the suite) added nothing those do not check.
# It also explores two model-side axes beside the LR (dropout around model.dropout, label
# smoothing in the training loss), their logged values held to the Simulator
# (test_train_axes.check_axis_values; the other backends' axes: test_train_axes).
FSDP2_AXES = {"lr": {"spread_ratio": 0.111}, "dropout": {"spread_ratio": 0.05, "kind": "additive"},
              "label_smoothing": {"spread_ratio": 0.04, "kind": "additive", "value": 0.05}}


@pytest.mark.parametrize("backend", ["fsdp2"])
def test_default_job_on_every_backend(tmp_path, backend):
    from test_train_axes import check_axis_values

    run_dir = tmp_path / "run"
    args = [a for a in SHORT if not a.startswith(("train.steps", "deepspeed.hdet.auto.warmup_steps", "train.progress"))]
    # schedule-free's own warm-up (60 steps in the packaged job) shortened to the 20-step run
    args += ["train.steps=20", "deepspeed.hdet.auto.warmup_steps=10", "deepspeed.optimizer.params.warmup_steps=4",
             f"backend={backend}", "model.dropout=0.1",
             f"deepspeed.hdet.axes={json.dumps(FSDP2_AXES)}", "train.progress=true"]
    proc = hdet_train([f"run_dir={run_dir}", *args], timeout=400)
    check_run(run_dir, proc, backend, steps=20, warmup=10)
    check_axis_values(run_dir, FSDP2_AXES, "label_smoothing", steps=20, sync=10, dropout=0.1)
    check_progress_bar(run_dir, proc.stderr, steps=20)


def check_progress_bar(run_dir, stderr: str, steps: int) -> None:
    """Each progress-bar update shows its step's loss beside the LR that step ran with on
    replica 0 (not the next step's), as metrics.jsonl records them; tqdm
    prints at most every 0.1 s, so some steps have no update: the last one always does, once.
    Every update of a step shows that step's pair (none a step's count with the values of
    the step before)."""
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "hdet/loss" in r}
    shown = [(int(m[1]), m[2], m[3]) for m in re.finditer(r"(\d+)/\d+ \[[^]]*, loss=([\d.]+), lr=([\d.e+-]+)\]",
                                                           stderr)]
    assert steps in {step for step, _, _ in shown}, stderr[-2000:]
    # the final line once, not drawn by the last update and again by close()
    assert [step for step, _, _ in shown].count(steps) == 1, stderr[-2000:]
    for step, loss, lr in shown:
        assert lr == f"{records[step]['hdet/lr/replica_0/group_0']:.2e}", (step, lr)
        assert loss == f"{records[step]['hdet/loss']:.3f}", (step, loss)


def check_run(run_dir, proc, backend: str, steps: int = 40, warmup: int = 20) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("val_loss", "val_ppl", "unigram_entropy", "steps", "world_size", "replicas", "shard_size",
                "tokens_per_s", "wall_s"):
        assert key in summary, key
    assert (summary["steps"], summary["world_size"], summary["replicas"], summary["shard_size"]) == (steps, 4, 2, 2)
    assert summary["backend"] == backend
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    # 40 steps already learn more than the byte distribution: the unigram entropy of
    # Python source is ~3.3 nats, an untrained model ~ln 256 = 5.5; 20 steps get close.
    assert summary["val_loss"] < summary["unigram_entropy"] - (0.15 if steps >= 40 else -0.3), summary
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if "hdet/loss" in r]
    syncs = [r for r in records if "hdet/sync" in r]
    assert [r["step"] for r in step_records] == list(range(1, steps + 1))
    assert all(r["train/tokens_per_s"] > 0 for r in step_records)
    assert [r["hdet/step"] for r in syncs] == list(range(10, steps + 1, 10))
    loss_of = {r["step"]: r["train/loss"] for r in step_records}
    # the last step's loss over all ranks, not rank 0's alone; the ranks
    # train on different batches, so the two differ
    assert summary["final_train_loss"] == loss_of[steps] != step_records[-1]["hdet/loss"]
    for r in syncs:
        losses = [r["hdet/loss/replica_0"], r["hdet/loss/replica_1"]]
        assert all(0 < x < 6 for x in losses)
        # train/loss (each step's loss averaged over the 4 ranks, one all-reduce per logged
        # step) against the sync's interval losses (each replica's ranks and steps, reduced
        # by the sync's own all-reduce): the same 40 numbers averaged in another order;
        # float32 losses summed in float64, so 1e-6 relative is rounding
        interval = [loss_of[t] for t in range(r["hdet/step"] - 9, r["hdet/step"] + 1)]
        assert sum(interval) / 10 == pytest.approx(sum(losses) / 2, rel=1e-6)
        assert r["hdet/converge_s"] >= 0
        # the next step's base; after the last step there is none
        assert ("hdet/lr/group_0/base" in r) == (r["hdet/step"] < steps)
    # auto-LR from the first sync at or after the warm-up: softmax weights sum to 1; the
    # two replicas' LRs are the base times 1 -+ 0.111 (in that interval's permutation)
    for r in syncs:
        if r["hdet/step"] < warmup:
            assert "hdet/weight/replica_0" not in r
        else:
            assert r["hdet/weight/replica_0"] + r["hdet/weight/replica_1"] == pytest.approx(1.0, abs=1e-12)
    for r in step_records:
        lrs = sorted([r["hdet/lr/replica_0/group_0"], r["hdet/lr/replica_1/group_0"]])
        assert lrs[1] / lrs[0] == pytest.approx(1.111 / 0.889, rel=1e-9)
    # The default controller ("log") with probe fitness: every auto-LR sync scored both
    # replicas on the probe batches (per-sequence losses: their noise is logged), and the
    # base LR it published is the packaged schedule (constant: schedule-free AdamW warms
    # up itself) at its peak 2.5e-3 times the multiplier.
    meta = [r for r in syncs if r["hdet/step"] >= warmup]
    assert meta
    for r in meta:
        fitness = [r["hdet/fitness/replica_0"], r["hdet/fitness/replica_1"]]
        assert all(0 < x < 6 for x in fitness) and fitness[0] != fitness[1]
        assert r["hdet/fitness_noise"] > 0
        if r["hdet/step"] < steps:
            assert r["hdet/lr/group_0/base"] == pytest.approx(2.5e-3 * r["hdet/lr/group_0/multiplier"], rel=1e-9)
    assert len({r["hdet/lr/group_0/multiplier"] for r in meta}) == len(meta)  # it moved at every update

    ckpt = run_dir / "checkpoint"
    tag = (ckpt / "latest").read_text()
    for r in range(2):
        names = os.listdir(ckpt / f"replica_{r}" / tag)
        assert {"hdet_shard_0.pt", "hdet_shard_1.pt"} <= set(names)
    assert json.loads((ckpt / "hdet_layout.json").read_text()) == {
        "world_size": 4, "replicas": 2, "shard_size": 2, "step": steps, "total_steps": steps, "backend": backend,
        "checkpoints": {f"global_step{steps}": steps},  # the index of complete checkpoints (checkpoint_io)
        "manifests": [f"global_step{steps}"]}  # the tags saved with a manifest (manifest.py)


# Bad input to the launcher (config, data, run_dir, resume, files): test_bad_inputs.py.


def test_bad_input_under_a_launcher_fails_on_every_rank_without_hanging(tmp_path):
    """As under torchrun: 4 ranks each run the CLI; all must exit 2 before any collective
    (the harness kills everything and fails after 90 s if one hangs), and rank 0 alone
    prints the message: the check reads the same config on every rank."""
    argv = [f"run_dir={tmp_path / 'run'}", "deepspeed.hdet.axes.lr.spread_ratio=1.5"]
    t0 = time.monotonic()
    # torchrun's own mark: a RANK without one is a shell's leftover and speaks
    results = run_ranks(cli_rank, 4, args=(argv,), timeout=90, env={"TORCHELASTIC_RUN_ID": "test"})
    assert [r["code"] for r in results] == [2, 2, 2, 2]
    assert "hdet.axes.lr.spread_ratio" in results[0]["stderr"]
    assert not any("hdet-train: error" in r["stderr"] for r in results[1:]), [r["stderr"] for r in results]
    assert time.monotonic() - t0 < 90


def test_torchrun_restarts_repeat_a_refusal_without_checking_again(tmp_path):
    """Under ``torchrun --max-restarts=3`` a bad input the ranks' own checks find (a
    parameter group the optimizer lacks: found after torch and the engine code are
    imported) is refused by the first attempt; each of the 3 restarts repeats rank 0's
    message from the marker the first attempt left (``train/refusals.py``) instead of
    importing and checking again (53 s for 4 DeepSpeed ranks, measured). Every
    attempt's message is the first one's, word for word; the job ends within the 30 s
    bad-input bar."""
    argv = [f"run_dir={tmp_path / 'run'}", "backend=ddp", "wandb.enabled=false", "deepspeed.hdet.axes.lr.groups=[3]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts=3",
           "-m", "hdet_scale.train.cli", *argv]
    message = "hdet-train: error: deepspeed.hdet.axes.lr.groups: group 3 does not exist"
    t0 = time.monotonic()
    # torchrun's store unshared, as launchers/ set it (else the shared-store refusal comes first)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    seconds = time.monotonic() - t0
    errors = [line for line in done.stderr.splitlines() if line.startswith(message)]
    repeated = [line for line in done.stderr.splitlines() if "the first attempt refused this input" in line]
    assert done.returncode != 0 and len(errors) == 4, done.stderr[-3000:]
    assert len(set(errors)) == 1, errors  # word for word
    assert [line.split("restart ")[1][0] for line in repeated] == ["1", "2", "3"], done.stderr[-3000:]
    assert seconds < 30, seconds


def test_a_quiet_rank_that_refuses_waits_for_the_launcher_to_end_it(tmp_path):
    """A rank other than 0 that refuses an input prints nothing and does not exit at once:
    torchrun's agent would then end rank 0 before it printed the one line (the last
    restart's message lost, 3 of 4 printed). It waits (up to
    ``refusals.QUIET_RANK_WAIT_S``) until the launcher ends it, as the agent does when rank
    0 exits; here the test plays the agent: the rank is still running after 2 s, and a
    SIGTERM ends it at once. Rank 0 with the same input exits at once with the message."""
    import signal

    argv = [f"run_dir={tmp_path / 'run'}", "wandb.enabled=false", "deepspeed.hdet.sync_intervall=3"]
    env = {**ENV, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
           "LOCAL_RANK": "1", "RANK": "1", "TORCHELASTIC_RUN_ID": "test"}  # torchrun's mark, as the agent sets it
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    rank1 = subprocess.Popen([sys.executable, "-m", "hdet_scale.train.cli", *argv], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank0 = subprocess.run([sys.executable, "-m", "hdet_scale.train.cli", *argv], capture_output=True, text=True,
                           timeout=60, env={**env, "LOCAL_RANK": "0", "RANK": "0"})
    assert rank0.returncode == 2 and "sync_intervall" in rank0.stderr, rank0.stderr[-2000:]
    time.sleep(2)
    assert rank1.poll() is None, "rank 1 exited before the launcher ended it: rank 0's line can be lost"
    rank1.send_signal(signal.SIGTERM)
    _, err = rank1.communicate(timeout=10)
    assert rank1.returncode == -signal.SIGTERM and "hdet-train: error" not in err, err[-2000:]


def test_a_new_run_never_replaces_what_run_dir_holds(tmp_path):
    """A run_dir with an earlier run's metrics is refused before any rank starts, and the
    file is left as it was; train.overwrite=true lets validation through (checked here
    without training: validate is what every rank and the launcher run first)."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = hdet_train([f"run_dir={run_dir}", "wandb.enabled=false"], timeout=60)
    assert proc.returncode == 2 and "already holds a run (metrics.jsonl)" in proc.stderr, proc.stderr[-2000:]
    assert "train.overwrite=true" in proc.stderr and "Traceback" not in proc.stderr
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    validate(load_run_config(None, [f"run_dir={run_dir}", "train.overwrite=true"]), 4)
