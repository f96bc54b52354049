"""``hdet-train`` with model-side and optimizer-side axes beside the LR, on every backend,
held to the ``Simulator``.

One short run per backend (a 1-layer Llama; 4 ranks = 2 replicas x 2 shards on
the sharded engines, whose shard ranks must all set their replica's value; 2 ranks = 2
replicas x 1 on DDP and fairscale, to halve their start-up; 6 steps, syncs at 2, 4 and
6), each exploring the LR and dropout plus one more axis: temperature
(deepspeed), beta2 (ddp), eps (fairscale); test_train's FSDP2 job explores dropout and
label smoothing, checked by :func:`check_axis_values`. The axes other than
the LR have auto off, so their values are a pure function of the config and the step
(the permutations come from the scheduler's own generator seeded by ``hdet.seed``): the
``Simulator`` run on a small model with the same block must log the same per-replica
values at every step, exactly (the same float64 arithmetic on the same inputs).

That the values reach the modules (every ``nn.Dropout`` / attention dropout, the
attention scaling) is tested in tests/unit/test_model_axes.py; that a model-side axis
trains the same on every backend as in the ``Simulator`` in test_agreement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from hdet_scale import Simulator

pytestmark = pytest.mark.timeout(600)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
STEPS, SYNC, DROPOUT = 6, 2, 0.1
TINY = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
        "model.num_kv_heads=2", "data.max_bytes=200000", "train.eval_batches=2", f"train.steps={STEPS}",
        f"deepspeed.hdet.sync_interval={SYNC}", "deepspeed.hdet.auto.warmup_steps=2", "train.plots=false",
        "train.progress=false", "wandb.mode=disabled", f"model.dropout={DROPOUT}", "train.checkpoint=false"]
AXES = {"lr": {"spread_ratio": 0.111}, "dropout": {"spread_ratio": 0.05, "kind": "additive"}}
# fsdp2: test_train's FSDP2 job explores dropout and label smoothing (one launch fewer)
EXTRA = {"deepspeed": ("temperature", {"spread_ratio": 0.2}),
         "ddp": ("beta2", {"spread_ratio": 0.0005, "kind": "additive"}),
         "fairscale": ("eps", {"spread_ratio": 0.5})}


class Oracle(nn.Module):
    """Something for every model-side axis to set (values only are compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.drop = nn.Dropout(DROPOUT)
        self.tau = 1.0

    def hdet_set_temperature(self, tau: float) -> None:
        self.tau = tau

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) / self.tau


def simulated_values(axes: dict, steps: int = STEPS, sync: int = SYNC, dropout: float = DROPOUT) -> list[dict]:
    """Per step 1..steps, ``{key: value}`` of every axis but the LR, as the Simulator's
    scheduler applies them (hdet-train's defaults: AdamW betas (0.9, 0.95), eps 1e-8)."""
    block = {"replicas": 2, "sync_interval": sync, "axes": {**axes, "dropout": {**axes["dropout"], "value": dropout}},
             "schedule": {"name": "onecycle", "total_steps": steps, "pct_start": 0.2}, "auto": {"enabled": False}}
    sim = Simulator(Oracle, lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), eps=1e-8), block)
    out = []
    for _ in range(steps):
        before = {f"hdet/{a}/replica_{r}/group_0": v for (a, g), vals in sim.scheduler.applied.items()
                  if a != "lr" and g == 0 for r, v in enumerate(vals)}
        sim.step(lambda m, r: m(torch.ones(1, 2)).sum())
        out.append(before)
    return out


def check_axis_values(run_dir, axes: dict, name: str, steps: int = STEPS, sync: int = SYNC,
                      dropout: float = DROPOUT) -> None:
    """The run's logged per-replica values of every axis but the LR equal the Simulator's
    at every step (exactly), and the replicas ran different values of dropout and ``name``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "hdet/loss" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))
    for r, ref in zip(logged, simulated_values(axes, steps, sync, dropout)):
        assert {k for k in ref if k.startswith(f"hdet/{name}/")} and {k for k in ref if "dropout" in k}
        for key, value in ref.items():
            assert r[key] == value, (r["step"], key, r[key], value)
    for axis in ("dropout", name):
        assert logged[0][f"hdet/{axis}/replica_0/group_0"] != logged[0][f"hdet/{axis}/replica_1/group_0"]


@pytest.mark.parametrize("backend", list(EXTRA))
def test_hdet_train_explores_model_and_optimizer_axes_as_the_simulator(tmp_path, backend):
    name, spec = EXTRA[backend]
    axes = {**AXES, name: spec}
    run_dir = tmp_path / "run"
    nproc = 4 if backend in ("deepspeed", "fsdp2") else 2
    proc = subprocess.run([sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={run_dir}", f"backend={backend}",
                           f"nproc={nproc}", *TINY, f"deepspeed.hdet.axes={json.dumps(axes)}"],
                          capture_output=True, text=True, timeout=400, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_axis_values(run_dir, axes, name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] < 5.6  # ln 256 = 5.55: an untrained byte model
