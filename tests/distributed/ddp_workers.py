"""Rank worker functions for tests/distributed/test_ddp.py (HDET on plain DDP, gloo, CPU).

Spawned rank processes import this module by name (``ddp_workers``; conftest.py puts the
folder on ``sys.path``). Workers return plain Python / numpy data, never torch tensors
(they would travel through shared memory that dies with the rank process); the test
process computes the single-process oracles and asserts.

Determinism: models are initialised from a dedicated seeded ``torch.Generator``, rank
``rank``'s batch for step ``t`` comes from a generator seeded with ``(rank, t)``, and no
worker reads the global RNG, so the oracles and a resumed run see the same numbers. The
helpers shared with the other backends' workers (seeded init, numpy conversion, collective
and checkpoint-write guards) live in ``rank_tools``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import buffer_arrays, clean_record, init_dist, rank

D_IN, D_HIDDEN, D_OUT, MICRO = 6, 12, 3, 4


# ---- model and data ----------------------------------------------------------------------

class TinyNet(torch.nn.Module):
    """Two Linear layers around a LayerNorm, plus a persistent float buffer (a running mean
    of the training inputs, like BatchNorm statistics) that does not enter the output:
    it differs between ranks unless something averages it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.norm = torch.nn.LayerNorm(D_HIDDEN)
        self.head = torch.nn.Linear(D_HIDDEN, D_OUT)
        self.register_buffer("input_mean", torch.zeros(D_IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.input_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.head(torch.tanh(self.norm(self.fc1(x))))


def _draw(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Every parameter N(0, 1) scaled by 1 / sqrt(fan_in) (matrices) or 0.1 (vectors)."""
    scale = 1 / math.sqrt(p.shape[1]) if p.dim() == 2 else 0.1
    return torch.randn(p.shape, generator=g) * scale


def build_model(seed: int = 0) -> TinyNet:
    """The same weights for a given seed, without touching the global RNG."""
    return rank_tools.seeded_model(TinyNet, seed, _draw)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch (MICRO samples) for optimizer step ``step`` (1-based)."""
    return rank_tools.seeded_batch(50_000 + 1_000 * rank + step, MICRO, D_IN, D_OUT)


def flat_params(model: torch.nn.Module) -> np.ndarray:
    return rank_tools.flat_numpy(model.parameters())


def buffers(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return buffer_arrays(model)


def group_values(opt: torch.optim.Optimizer) -> list[dict]:
    """LR and momentum (beta1 or SGD momentum) of every group: what the next step uses."""
    out = []
    for g in opt.param_groups:
        m = g["betas"][0] if "betas" in g else g.get("momentum")
        out.append({"lr": float(g["lr"]), "momentum": None if m is None else float(m)})
    return out


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, data_rank: int, step: int,
               pass_loss: bool = True) -> float:
    x, y = batch(data_rank, step)
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step(loss.detach() if pass_loss else None)
    return float(loss.detach())


def capture_converge(model: torch.nn.Module, sched: Any, store: list) -> None:
    """Wrap the sync's converge: record the parameters and buffers it is about to average
    (after the sync step's own optimizer update), then converge."""
    rank_tools.capture_converge(sched, store, lambda: {"params": flat_params(model), "buffers": buffers(model)})


def expect_config_error(fn) -> str:
    """Run ``fn`` with every collective and DeviceMesh creation forbidden; the error's class
    name and text (the test asserts the class: HDETConfigError, not AssertionError)."""
    return rank_tools.error_text(fn, device_mesh=True) or "no error"


# ---- launch 1: two ranks, OneCycleAutoLR -------------------------------------------------

PLAIN = dict(max_lr=0.05, total_steps=12, pct_start=0.4)  # SGD + momentum 0.9, cycled
PLAIN_STEPS = 12
HDET_ARGS = dict(max_lr=1e-2, total_steps=24, div_factor=5.0, final_div_factor=2.0)
HDET_KW = dict(ensemble_lr_spread_ratio=0.2, model_sync_interval=3, auto_lr_warmup_steps=6,
               enable_auto_lr=True, loss_scale=0.5, lr_of_lr=0.5, momentum_of_lr=0.9, seed=7)
HDET_STEPS = 16  # syncs at 3 .. 15; auto-LR from 6; stops mid-interval
ADAMW = dict(lr=1.0, weight_decay=0.01)
REPLICA_CFG = {"replicas": 2, "sync_interval": 4, "gradient_sharing": "replica",
               "axes": {"lr": {"spread_ratio": 0.0}},
               "schedule": {"name": "constant", "total_steps": 20, "max_lr": 0.1}}
REPLICA_STEPS = 5


def _plain(out: dict) -> None:
    """(a) spread 0, auto-LR off: plain DDP + OneCycleLR; no process group of its own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hdet_scale import OneCycleAutoLR
    ddp = DDP(build_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0, momentum=0.9)
    sched = OneCycleAutoLR(opt, **PLAIN, model=ddp)
    out["plain_topology"] = sched.topology is not None
    out["plain_values"], out["plain_params"] = [], []
    for step in range(1, PLAIN_STEPS + 1):
        out["plain_values"].append(group_values(opt))
        train_step(ddp, opt, sched, rank(), step)
        out["plain_params"].append(flat_params(ddp.module))
    out["plain_values"].append(group_values(opt))


def _hdet(out: dict) -> None:
    """(b) spread 0.2, auto-LR after 6 steps, sync every 3; DDP with broadcast_buffers
    off, so each rank's buffer follows its own data and only converge averages it. Then
    rank 0's state_dict loaded on every rank (fresh scheduler) must give each rank its own
    LR, and a last_epoch resume (auto-LR off) must replay the same LRs."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hdet_scale import OneCycleAutoLR
    ddp = DDP(build_model(), forward_sync_buffers=False)
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
    sched = OneCycleAutoLR(opt, **HDET_ARGS, model=ddp, **HDET_KW)
    out["hdet_replica"] = sched.topology.replica_index
    captured: list = []
    capture_converge(ddp.module, sched, captured)
    values, params, bufs, records, bases = [], [], [], {}, []
    for step in range(1, HDET_STEPS + 1):
        values.append(group_values(opt))
        train_step(ddp, opt, sched, rank(), step)
        params.append(flat_params(ddp.module))
        bufs.append(buffers(ddp.module))
        bases.append(sched.base_value("lr", 0))
        if step % HDET_KW["model_sync_interval"] == 0:
            records[step] = clean_record(sched.last_sync)
    values.append(group_values(opt))
    try:  # auto-LR needs the loss: refused before any state change or collective
        sched.step()
        out["no_loss_error"] = None
    except ValueError as e:
        out["no_loss_error"] = str(e)
    out["step_after_no_loss"] = sched.step_count
    out.update(hdet_values=values, hdet_params=params, hdet_buffers=bufs, hdet_records=records,
               hdet_captured=captured, hdet_bases=bases)

    # State of rank 0 on every rank: the state holds no rank, each keeps its own multiplier.
    state = [sched.state_dict() if rank() == 0 else None]
    dist.broadcast_object_list(state, src=0)
    opt2 = torch.optim.AdamW(build_model().parameters(), **ADAMW)
    fresh = OneCycleAutoLR(opt2, **HDET_ARGS, model=ddp, **HDET_KW)
    fresh.load_state_dict(state[0])
    out["state_from_rank0_lrs"] = [g["lr"] for g in opt2.param_groups]
    out["own_lrs"] = [g["lr"] for g in opt.param_groups]

    # last_epoch resume without auto-LR: LRs from step 8 on equal the uninterrupted run.
    kw = dict(HDET_KW, enable_auto_lr=False)
    model = build_model()
    opt_a = torch.optim.AdamW(model.parameters(), **ADAMW)
    a = OneCycleAutoLR(opt_a, **HDET_ARGS, model=model, **kw)
    lrs_a = []
    for _ in range(12):
        a.step()
        lrs_a.append(opt_a.param_groups[0]["lr"])
    opt_b = torch.optim.AdamW(model.parameters(), **ADAMW)
    b = OneCycleAutoLR(opt_b, **HDET_ARGS, model=model, last_epoch=7, **kw)
    lrs_b = [opt_b.param_groups[0]["lr"]]
    for _ in range(4):
        b.step()
        lrs_b.append(opt_b.param_groups[0]["lr"])
    out["resume_a"], out["resume_b"] = lrs_a[7:], lrs_b


def _replica_s1(out: dict) -> None:
    """``initialize`` 2 x 1 in "replica" mode: each rank starts from a different init (its
    own seed; initialize must hand it rank 0's), trains on its own data with no gradient
    all-reduce until the step-4 converge."""
    from hdet_scale.backends.ddp import initialize
    ddp, opt, sched = initialize(build_model(seed=10 + rank()), REPLICA_CFG,
                                 lambda ps: torch.optim.SGD(ps, lr=0.1))
    out["s1_init"] = flat_params(ddp.module)
    captured: list = []
    capture_converge(ddp.module, sched, captured)
    params = []
    for step in range(1, REPLICA_STEPS + 1):
        train_step(ddp, opt, sched, rank(), step)
        params.append(flat_params(ddp.module))
    out["s1_params"], out["s1_captured"] = params, captured


def _bad_arguments(out: dict) -> None:
    """(e) bad OneCycleAutoLR arguments with torch.distributed up: HDETConfigError on this
    rank by itself, before any collective."""
    from hdet_scale import OneCycleAutoLR
    model = build_model()

    def make(**kw):
        def f():
            OneCycleAutoLR(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9), model=model, **kw)
        return f

    cases = {
        "sync_interval_zero": make(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=0.1, model_sync_interval=0),
        "no_total_steps": make(max_lr=0.1, ensemble_lr_spread_ratio=0.1),
        "warmup_past_end": make(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=0.1, enable_auto_lr=True,
                                model_sync_interval=10, auto_lr_warmup_steps=95),
        "world_size_mismatch": make(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=0.1, world_size=4),
        "last_epoch_with_auto": make(max_lr=0.1, total_steps=100, ensemble_lr_spread_ratio=0.1,
                                     enable_auto_lr=True, auto_lr_warmup_steps=10, model_sync_interval=10,
                                     last_epoch=20),
    }
    out["bad"] = {name: expect_config_error(fn) for name, fn in cases.items()}


def pair_worker() -> dict:
    """Launch 1 (2 ranks): the four parts above, in one process per rank."""
    import torch.distributed as dist
    init_dist()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    _bad_arguments(out)
    _plain(out)
    _hdet(out)
    _replica_s1(out)
    dist.barrier()
    out["seconds"] = time.monotonic() - t0
    return out


# ---- launch 2: four ranks, initialize 2 x 2 ---------------------------------------------

S = 2
MESH_STEPS = 4  # sync at 3
RESUME_STEPS, RESUME_AT = 8, 4  # syncs at 3 and 6; stop between them


def mesh_cfg(**overrides: Any) -> dict:
    block: dict[str, Any] = {"replicas": 2, "sync_interval": 3, "gradient_sharing": "replica", "seed": 5,
                             "axes": {"lr": {"spread_ratio": 0.3}},
                             "schedule": {"name": "onecycle", "total_steps": 12, "max_lr": 5e-3}}
    block.update(overrides)
    return block


def _adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def _independence(out: dict) -> None:
    """(c) two runs of 2 x 2 "replica" mode; in the second, replica 1 trains on other data.
    Replica 0 must not notice before the step-3 converge."""
    from hdet_scale.backends.ddp import initialize
    r = rank()
    for run in ("same", "other"):
        ddp, opt, sched = initialize(build_model(), mesh_cfg(), _adamw)
        captured: list = []
        capture_converge(ddp.module, sched, captured)
        data_rank = r + 100 if (run == "other" and r >= S) else r
        params, lrs = [], []
        for step in range(1, MESH_STEPS + 1):
            lrs.append([g["lr"] for g in opt.param_groups])
            train_step(ddp, opt, sched, data_rank, step)
            params.append(flat_params(ddp.module))
        out[f"{run}_params"], out[f"{run}_lrs"], out[f"{run}_captured"] = params, lrs, captured
        out[f"{run}_buffers"] = buffers(ddp.module)
        out["replica"] = sched.topology.replica_index
        out["base"] = [sched.schedule.value(t, 5e-3) for t in range(MESH_STEPS)]


def _resume(out: dict, ckpt_dir: str) -> None:
    """(d) A: 8 steps uninterrupted. B: 4 steps (between the syncs at 3 and 6), save.
    C: fresh initialize from other weights, load, steps 5-8. D: a 4 x 1 layout refuses the
    checkpoint before any collective."""
    from hdet_scale.backends.ddp import initialize, load_checkpoint, save_checkpoint
    from hdet_scale.errors import HDETStateError
    # auto-LR on its default path: the "log" controller scored by the probe loss
    cfg = mesh_cfg(auto={"enabled": True, "warmup_steps": 3},
                   schedule={"name": "onecycle", "total_steps": 10, "max_lr": 5e-3, "div_factor": 5.0,
                             "final_div_factor": 2.0})
    probe = rank_tools.make_probe(rank() % S, S, d_in=D_IN, d_out=D_OUT)

    def init(model, config=cfg):
        return initialize(model, config, _adamw, probe=probe)

    def run(ddp, opt, sched, first, last, key):
        lrs = out.setdefault(f"{key}_lrs", {})
        for step in range(first, last + 1):
            lrs[step] = [g["lr"] for g in opt.param_groups]
            train_step(ddp, opt, sched, rank(), step)

    def state(ddp, opt, sched):
        return {"params": flat_params(ddp.module), "buffers": buffers(ddp.module),
                "exp_avg_sq": np.concatenate([opt.state[p]["exp_avg_sq"].reshape(-1).numpy()
                                              for p in ddp.module.parameters()]),
                "sched": {**rank_tools.sched_state(sched), "sync": sched.state_dict()["sync"]}}

    ddp, opt, sched = init(build_model())
    run(ddp, opt, sched, 1, RESUME_STEPS, "A")
    out["A"] = state(ddp, opt, sched)

    ddp, opt, sched = init(build_model())
    run(ddp, opt, sched, 1, RESUME_AT, "B")
    out["B_params"] = flat_params(ddp.module)
    written: list = []
    with rank_tools.record_writes(ckpt_dir, written):
        out["tag"] = save_checkpoint(ddp, opt, sched, ckpt_dir)
    out["written"] = written

    ddp, opt, sched = init(build_model(seed=1))
    out["C_before_load"] = flat_params(ddp.module)
    out["C_loaded_tag"] = load_checkpoint(ddp, opt, sched, ckpt_dir)
    out["C_after_load"] = flat_params(ddp.module)
    run(ddp, opt, sched, RESUME_AT + 1, RESUME_STEPS, "C")
    out["C"] = state(ddp, opt, sched)

    ddp, opt, sched = init(build_model(), {**cfg, "replicas": 4})
    out["D_error"] = rank_tools.error_text(lambda: load_checkpoint(ddp, opt, sched, ckpt_dir),
                                          (HDETStateError, AssertionError), device_mesh=True)


BAD_CONFIGS = {
    "replicas": lambda: mesh_cfg(replicas=3),
    "spread_ratio": lambda: mesh_cfg(axes={"lr": {"spread_ratio": 1.5}}),
    "unknown_key": lambda: mesh_cfg(sync_intervall=3),
    "max_lr_list": lambda: mesh_cfg(schedule={"name": "onecycle", "total_steps": 12, "max_lr": [1e-3, 1e-3]}),
    "process_group": lambda: mesh_cfg(),
}


def _bad_configs(out: dict) -> None:
    """(e) bad configs for initialize, torch.distributed up: HDETConfigError on this rank
    by itself, with no collective and no mesh creation attempted."""
    import torch.distributed as dist

    from hdet_scale.backends.ddp import initialize
    res = {}
    for name, cfg in BAD_CONFIGS.items():
        kw = {"ddp_kwargs": {"process_group": dist.group.WORLD}} if name == "process_group" else {}
        res[name] = expect_config_error(lambda: initialize(build_model(), cfg(), _adamw, **kw))
    out["bad"] = res


def mesh_worker(ckpt_dir: str) -> dict:
    """Launch 2 (4 ranks = 2 replicas x 2 shards)."""
    import torch.distributed as dist
    init_dist()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    _bad_configs(out)
    _independence(out)
    _resume(out, ckpt_dir)
    dist.barrier()
    out["seconds"] = time.monotonic() - t0
    return out
