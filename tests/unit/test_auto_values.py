"""``"auto"`` values in the hdet block, as Accelerate's DeepSpeed integration fills its own:
``schedule.max_lr: "auto"`` is the optimizer's LR (the same schedule as ``null``, held to
it value for value); ``schedule.total_steps: "auto"`` is the run's length, filled by
``hdet-train`` from ``train.steps`` (and by ``HDETTrainer``: test_hf_trainer) and refused,
naming who fills it, where no trainer knows the length."""

from __future__ import annotations

import pytest
import torch

from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError


def _lrs(max_lr) -> list[float]:
    # no sync within the 10 steps: the schedule alone sets the LRs (no process groups here)
    cfg = HDETConfig.from_dict({"replicas": 2, "sync_interval": 50, "axes": {"lr": {"spread_ratio": 0.2}},
                                "schedule": {"name": "onecycle", "total_steps": 20, "max_lr": max_lr}})
    opts = {r: torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3) for r in range(2)}
    sched = HDETScheduler(cfg, {r: o.param_groups for r, o in opts.items()})
    out = []
    for _ in range(10):
        out.append([opts[r].param_groups[0]["lr"] for r in range(2)])
        sched.step()
    return out


def test_max_lr_auto_is_the_optimizers_lr():
    auto, null = _lrs("auto"), _lrs(None)
    assert auto == null
    assert auto != _lrs(0.1)  # a given peak changes the schedule: the comparison can fail


def test_total_steps_auto_needs_a_trainer():
    with pytest.raises(HDETConfigError, match=r"hdet\.schedule\.total_steps: 'auto' is the run's length.*train\.steps"):
        HDETConfig.from_dict({"schedule": {"total_steps": "auto"}})


def test_hdet_train_fills_total_steps_auto_with_train_steps():
    from hdet_scale.train.config import load_run_config

    run = load_run_config(None, ["deepspeed.hdet.schedule.total_steps=auto", "train.steps=77"])
    assert run["deepspeed"]["hdet"]["schedule"]["total_steps"] == 77
