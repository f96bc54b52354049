"""Rank workers for tests/distributed/test_agreement.py: one HDET run per (backend,
gradient mode) on the same tiny model, data and seed, recording what the simulator
(``hdet_scale.Simulator``, run in the test process) is compared with.

World layouts: FSDP2, fairscale OSS and DeepSpeed ZeRO-3 run on 4 ranks = 2 replica
groups x 2 shards (global rank g = 2 r + s); DDP on 2 ranks, one replica each. Every
replica sees the same samples in every layout: rank g of the 4-rank world takes
``batch(g, t)``; DDP rank r takes ``batch(2r, t)`` and ``batch(2r + 1, t)`` concatenated,
and simulator replica r the same concatenation. The loss is a mean over samples of equal
count, so the replica's loss (mean over its shard ranks) and its gradient are the same
function of the same samples in every layout; only float32 summation order differs.

Workers return plain Python / numpy data (tensors would travel through shared memory
that dies with the rank process). Seeded init and numpy conversion come from
``rank_tools``, shared with the per-backend workers.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import flat_numpy, rank

D_IN, D_HIDDEN, D_OUT, MICRO = 8, 16, 3, 2
LR, WEIGHT_DECAY = 2e-2, 0.01
REPLICAS, SHARDS = 2, 2
STEPS, SYNC = 12, 3  # syncs at 3, 6, 9, 12; the run ends on a converge


class TinyNet(torch.nn.Module):
    """No training-time buffers (those are tested per backend): a buffer updated by each
    rank from its own micro-batch has no single-process counterpart. ``head`` has 3
    outputs, so FSDP2 shards its dim 0 unevenly over 2 ranks (2 + 1 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.norm = torch.nn.LayerNorm(D_HIDDEN)
        self.fc2 = torch.nn.Linear(D_HIDDEN, D_HIDDEN)
        self.head = torch.nn.Linear(D_HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def build_model() -> TinyNet:
    """Same weights everywhere, without touching the global RNG."""
    return rank_tools.seeded_model(TinyNet, 0)


def batch(g: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global rank ``g``'s micro-batch (of the 4-rank layout) for optimizer step ``step``."""
    return rank_tools.seeded_batch(20_000 + 1_000 * g + step, MICRO, D_IN, D_OUT)


def replica_batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of replica ``r`` (its shard ranks' micro-batches, concatenated)."""
    parts = [batch(r * SHARDS + s, step) for s in range(SHARDS)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def hdet_block(mode: str) -> dict:
    """R = 2, spread 0.3, sync every 3 steps, auto-LR from the second sync (warm-up 5:
    meta-updates at steps 6, 9, 12), OneCycle over the 12 steps. A low temperature makes
    the softmax weights depart from 1/2 on these small loss gaps, so the base LR really
    moves. ``max_lr`` is left to each optimizer's ``lr`` (the path a backend could break by
    touching the optimizer before the scheduler reads it)."""
    return {"replicas": REPLICAS, "sync_interval": SYNC, "gradient_sharing": mode, "seed": 7,
            "axes": {"lr": {"spread_ratio": 0.3}},
            "schedule": {"name": "onecycle", "total_steps": STEPS, "pct_start": 0.25,
                         "final_div_factor": 10.0},
            "auto": {"enabled": True, "warmup_steps": 5, "temperature": 0.01}}


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


class Recorder:
    """Per step: the LR of this rank's optimizer (group 0) for the coming step; per sync:
    the permutations and base values the scheduler chose."""

    def __init__(self, sched: Any, groups: Any) -> None:
        self.sched, self.groups = sched, groups
        self.lrs = [float(groups()[0]["lr"])]
        self.syncs: list[dict] = []

    def after_step(self) -> None:
        self.lrs.append(float(self.groups()[0]["lr"]))
        if self.sched.step_count % SYNC == 0:
            self.syncs.append({"step": self.sched.step_count,
                               "permutations": {f"{a}/{g}": list(p) for (a, g), p in self.sched.permutations.items()},
                               "base": self.sched.base_value("lr", 0),
                               "applied": list(self.sched.applied[("lr", 0)])})

    def result(self, params: np.ndarray) -> dict:
        t = self.sched.topology
        return {"lrs": self.lrs, "syncs": self.syncs, "params": params, "replica": t.replica_index,
                "shard": t.shard_index}


def _run_torch(model: Any, opt: Any, sched: Any, data: Any, full_params: Any) -> dict:
    rec = Recorder(sched, lambda: opt.param_groups)
    for step in range(1, STEPS + 1):
        x, y = data(step)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step(loss.detach())
        rec.after_step()
    return rec.result(full_params())


def run_fsdp2(mode: str) -> dict:
    from hdet_scale.backends import fsdp2

    model, opt, sched = fsdp2.initialize(build_model(), hdet_block(mode), adamw,
                                         shard_modules=lambda m: [m.fc1, m.fc2, m.head])
    g = rank()

    def full() -> np.ndarray:
        return flat_numpy(p.full_tensor() for p in model.parameters())

    return _run_torch(model, opt, sched, lambda t: batch(g, t), full)


def run_fairscale(mode: str) -> dict:
    from hdet_scale.backends import fairscale

    model, opt, sched = fairscale.initialize(build_model(), hdet_block(mode), torch.optim.AdamW,
                                             {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": False})
    g = rank()
    return _run_torch(model, opt, sched, lambda t: batch(g, t), lambda: flat_numpy(model.module.parameters()))


def run_ddp(mode: str) -> dict:
    from hdet_scale.backends import ddp

    model, opt, sched = ddp.initialize(build_model(), hdet_block(mode), adamw)
    r = rank()
    return _run_torch(model, opt, sched, lambda t: replica_batch(r, t), lambda: flat_numpy(model.module.parameters()))


def run_deepspeed(mode: str) -> dict:
    import deepspeed

    from hdet_scale import initialize

    model = build_model()
    # DeepSpeed 0.19 clips the gradient norm at 1.0 unless told otherwise
    # (GRADIENT_CLIPPING_DEFAULT); the other runs do not clip.
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
           "hdet": hdet_block(mode)}
    engine, _, _, sched = initialize(model, cfg, optimizer=adamw(model.parameters()))
    g = rank()
    rec = Recorder(sched, lambda: engine.optimizer.param_groups)
    for step in range(1, STEPS + 1):
        x, y = batch(g, step)
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step(lr_kwargs={"loss": loss.detach()})
        rec.after_step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        full = flat_numpy(params)
    return rec.result(full)


def launch_sharded(modes: list[str]) -> dict:
    """4 ranks: FSDP2, fairscale OSS and DeepSpeed ZeRO-3 (2 x 2), each gradient mode."""
    warnings.filterwarnings("ignore")
    out = {}
    for mode in modes:
        out[("fsdp2", mode)] = run_fsdp2(mode)
        out[("fairscale", mode)] = run_fairscale(mode)
        out[("deepspeed", mode)] = run_deepspeed(mode)
    return out


def launch_ddp(modes: list[str]) -> dict:
    """2 ranks: DDP, one replica per rank, each gradient mode."""
    warnings.filterwarnings("ignore")
    return {("ddp", mode): run_ddp(mode) for mode in modes}
