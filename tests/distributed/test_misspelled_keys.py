"""Misspelled keys through the real entry points: ``hdet-train`` and ``hdet-dryrun`` as a
user runs them, and ``hdet_scale.initialize`` on a real one-rank DeepSpeed engine.

The command-line cases are validated before any rank starts (no DeepSpeed start), so all
of them run at once as subprocesses; each must exit with code 2 within 30 s, name the
key and the closest valid one, print no traceback, and leave no process behind (each
runs in its own session; after it exits, its process group must be gone).

The library case (one rank, gloo, ZeRO-3): an ``"hdett"`` block is refused before
``torch.distributed`` is touched; a misspelt key only warns and the engine trains; a
loss of the wrong type given to ``engine.step(lr_kwargs=...)`` is refused before the
update (DeepSpeed's TypeError fallback would record ``train_batch_size``, 32, as the
loss). Compared exactly (no tolerance): the fp32 master partition before and after the
refused call (nothing ran), and the interval loss of the sync with the mean of the two
losses handed over, computed here in float64 as the sync does (a sum of two float64
values and one division).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import run_ranks

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGED = os.path.join(ROOT, "hdet_scale", "train", "configs", "deepspeed.json")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONWARNINGS": "ignore"}
EXIT_WITHIN_S = 30


def _json(tmp_path, name: str, edit) -> str:
    with open(PACKAGED) as f:
        ds = json.load(f)
    edit(ds)
    path = tmp_path / name
    path.write_text(json.dumps(ds))
    return str(path)


def _hdett(ds):
    ds["hdett"] = ds.pop("hdet")


def _typos(ds):
    ds["train_micro_batch_size_per_gpuu"] = ds.pop("train_micro_batch_size_per_gpu")
    ds["optimizer"]["params"]["learning_rate"] = ds["optimizer"]["params"].pop("lr")


TRAIN = [sys.executable, "-m", "hdet_scale.train.cli"]
DRYRUN = [sys.executable, "-m", "hdet_scale.dryrun"]


def test_cli_refuses_misspelled_keys(tmp_path):
    hdett = _json(tmp_path, "hdett.json", _hdett)
    typos = _json(tmp_path, "typos.json", _typos)
    run = f"run_dir={tmp_path / 'run'}"
    cases = {
        "dryrun hdett": (DRYRUN + [hdett, "--world-size", "4"], ["hdett: ", "did you mean 'hdet'?",
                                                                 "trains plain DeepSpeed"]),
        "train hdett override": (TRAIN + ["deepspeed.hdett.replicas=4", run],
                                 ["deepspeed.hdett: ", "did you mean 'hdet'?"]),
        "train typos": (TRAIN + [f"deepspeed_config={typos}", run],
                        ["deepspeed.train_micro_batch_size_per_gpuu: ",
                         "did you mean 'train_micro_batch_size_per_gpu'?",
                         "deepspeed.optimizer.params.learning_rate: ", "did you mean 'lr'?"]),
        "train pydantic block": (TRAIN + ["deepspeed.zero_optimization.stagee=3", run],
                                 ["deepspeed.zero_optimization.stagee: ", "did you mean 'stage'?"]),
        "train fsdp2": (TRAIN + ["backend=fsdp2", "deepspeed.gradient_clippingg=0.5", run],
                        ["deepspeed.gradient_clippingg: ", "did you mean 'gradient_clipping'?"]),
        "dryrun ddp typos": (DRYRUN + [typos, "--world-size", "8", "--backend", "ddp", "--total-steps", "10"],
                             ["train_micro_batch_size_per_gpuu: ", "did you mean 'train_micro_batch_size_per_gpu'?"]),
    }
    procs = {}
    for name, (cmd, _) in cases.items():
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                        cwd=tmp_path, start_new_session=True), time.monotonic())
    failures = []
    for name, (proc, t0) in procs.items():
        try:
            out, err = proc.communicate(timeout=EXIT_WITHIN_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            failures.append(f"{name}: still running after {EXIT_WITHIN_S + 30} s")
            continue
        took = time.monotonic() - t0
        try:
            os.killpg(proc.pid, 0)
            left = True
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            left = False
        needles = cases[name][1]
        missing = [n for n in needles if n not in err]
        if proc.returncode != 2 or missing or "Traceback" in err or took > EXIT_WITHIN_S or left:
            failures.append(f"{name}: rc={proc.returncode} took={took:.1f}s left={left} missing={missing}\n"
                            f"{err[-2000:]}")
    assert not failures, "\n\n".join(failures)


# ---- the library on a real one-rank engine ----------------------------------------------------

def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 3},
            "hdet": {"replicas": 1, "sync_interval": 2, "schedule": {"name": "constant", "total_steps": 10}},
            **extra}


def library_worker() -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    from hdet_scale.backends.deepspeed import initialize
    from hdet_scale.errors import HDETConfigError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    out: dict = {}
    bad = _config()
    bad["hdett"] = bad.pop("hdet")
    try:
        initialize(model, bad)
    except HDETConfigError as e:
        out["hdett_error"] = str(e)
    out["dist_touched_by_hdett"] = dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, sched = initialize(model, _config(steps_per_printt=5))
    out["warnings"] = [str(w.message) for w in caught if "steps_per_printt" in str(w.message)]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    losses = []
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step(lr_kwargs={"loss": loss.detach()})
    losses.append(float(loss))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    master = engine.optimizer.fp32_partitioned_groups_flat[0].clone()
    for wrong in ("0.5", 32, [float(loss)]):
        try:
            engine.step(lr_kwargs={"loss": wrong})
        except HDETConfigError as e:
            out.setdefault("wrong_errors", []).append(str(e))
    out["after_wrong"] = {"hdet_step": sched.step_count, "engine_steps": engine.global_steps,
                          "master_unchanged": torch.equal(master, engine.optimizer.fp32_partitioned_groups_flat[0])}
    engine.step(lr_kwargs={"loss": loss.detach()})  # the same step, now with its loss
    losses.append(float(loss))
    out["hdet_step"] = sched.step_count
    out["sync_loss"] = sched.last_sync["hdet/loss/replica_0"]
    out["expected_loss"] = (losses[0] + losses[1]) / 2
    return out


def test_library_refuses_hdett_warns_on_typos_and_refuses_a_wrong_loss():
    pytest.importorskip("deepspeed")
    from rank_tools import DS_ENV

    (r,) = run_ranks(library_worker, 1, timeout=180, env=DS_ENV)
    assert "hdett: " in r["hdett_error"] and "did you mean 'hdet'?" in r["hdett_error"], r
    assert r["dist_touched_by_hdett"] is False
    assert r["warnings"] and "did you mean 'steps_per_print'?" in r["warnings"][0], r
    assert len(r["wrong_errors"]) == 3, r
    assert "got str '0.5'" in r["wrong_errors"][0] and "train_batch_size" in r["wrong_errors"][1]
    assert r["after_wrong"] == {"hdet_step": 1, "engine_steps": 1, "master_unchanged": True}, r
    assert r["hdet_step"] == 2
    assert r["sync_loss"] == r["expected_loss"], r  # 32 would have made it ~16
