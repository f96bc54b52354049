"""Rank workers for tests/distributed/test_agreement.py: one HDET run per (backend,
controller, gradient mode) on the same tiny model, data and seed, plus one warm-init run
per backend, recording what the simulator (``hdet_scale.Simulator``, run in the test
process) is compared with.

World layouts: FSDP2, fairscale OSS and DeepSpeed ZeRO-3 run on 4 ranks = 2 replica
groups x 2 shards (global rank g = 2 r + s); DDP on 2 ranks, one replica each. Every
replica sees the same samples in every layout: rank g of the 4-rank world takes
``batch(g, t)``; DDP rank r takes ``batch(2r, t)`` and ``batch(2r + 1, t)`` concatenated,
and simulator replica r the same concatenation. The loss is a mean over samples of equal
count, so the replica's loss (mean over its shard ranks) and its gradient are the same
function of the same samples in every layout; only float32 summation order differs.

Probe fitness (the "log" runs): ``PROBE_ROWS`` fixed rows, split into ``SHARDS`` equal
slices. Shard rank s of each replica (2 x 2) evaluates slice s; a DDP rank (S = 1) and
the simulator's ``probe_fn`` evaluate all rows. Slices of equal size make the replica's
mean over its shard ranks the loss on all rows, in every layout.

Two optimizer parameter groups of different LRs in every run: the matrices (``LR``) and
the vectors (biases, LayerNorm; ``LR / 2``).

Workers return plain Python / numpy data (tensors would travel through shared memory
that dies with the rank process). Seeded init, probe slices and numpy conversion come
from ``rank_tools``, shared with the per-backend workers.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import flat_numpy, rank

D_IN, D_HIDDEN, D_OUT, MICRO = 8, 16, 3, 2
LR, WEIGHT_DECAY = 2e-2, 0.01
GROUP_LRS = (LR, LR / 2)  # matrices, vectors: the peaks' ratio the "tied" groups keep is 2
REPLICAS, SHARDS = 2, 2
STEPS, SYNC = 12, 3  # syncs at 3, 6, 9, 12; the run ends on a converge
WARMUP = 5  # first meta-update at the step-6 sync
CONTROLLERS = ("paper", "log")
TEMPERATURE = {"spread_ratio": 0.2, "auto": True}  # the "temperature" runs: "log" plus this model-side axis
NU, WARM_SEED = 0.05, 11  # warm init: noise std nu * RMS(model)
WARM_MODE = "replica"  # the warm-init runs: no gradient sharing, so only converge equalises
SF_WARMUP = 2  # the schedule-free runs: the optimizer's own warm-up (HDET's schedule is constant)
SAVE_AT = 7  # the schedule-free runs save here (mid-interval); a second run resumes from it


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
        self.tau = 1.0  # a model-side axis ("temperature") through the documented hook

    def hdet_set_temperature(self, tau: float) -> None:
        self.tau = float(tau)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h) / self.tau)  # / 1.0 is exact: the other runs are unchanged
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


def probe_slice(shard: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``shard`` of ``shards`` of the fixed probe rows (``shards`` = 1: all rows)."""
    return rank_tools.probe_slice(shard, shards, d_in=D_IN, d_out=D_OUT)


def forward_input() -> torch.Tensor:
    """A fixed input whose output shows what weights a rank's next forward reads."""
    return rank_tools.probe_input(D_IN)


def hdet_block(mode: str, controller: str = "paper", warm: bool = False) -> dict:
    """R = 2, spread 0.3, sync every 3 steps, auto-LR from the second sync (warm-up 5:
    meta-updates at steps 6, 9, 12), OneCycle over the 12 steps. ``max_lr`` is left to
    each optimizer group's ``lr`` (the path a backend could break by touching the
    optimizer before the scheduler reads it).

    ``controller``: "paper" is the paper's update, scored by the interval training loss,
    each parameter group explored on its own; a low temperature makes the softmax weights
    depart from 1/2 on these small loss gaps, so the base LR really moves. "log" is the
    default path: the log-space multiplier, scored by the probe loss, one multiplier and
    permutation for both groups ("tied"), automatic temperature. ``warm``: warm noisy
    initialisation with nu = ``NU``."""
    auto: dict[str, Any] = {"enabled": True, "warmup_steps": WARMUP}
    schedule = {"name": "onecycle", "total_steps": STEPS, "pct_start": 0.25, "final_div_factor": 10.0}
    if controller == "paper":
        auto.update(controller="paper", fitness="train_loss", groups="independent", temperature=0.01)
    elif controller == "schedulefree":  # the "log" path on schedule-free AdamW, which warms up itself
        auto.update(step_size=0.5)
        schedule = {"name": "constant", "total_steps": STEPS}
    else:
        # Pinned (not the default): the fitness gaps this trajectory produces were measured
        # with it, and must stay well above the fitness tolerance for the sign to be stable.
        auto.update(step_size=0.5)
    block = {"replicas": REPLICAS, "sync_interval": SYNC, "gradient_sharing": mode, "seed": 7,
             "axes": {"lr": {"spread_ratio": 0.3}},
             "schedule": schedule, "auto": auto}
    if warm:
        block["warm_init"] = {"enabled": True, "nu": NU, "seed": WARM_SEED}
    if controller == "temperature":
        block["axes"]["temperature"] = dict(TEMPERATURE)
    return block


def param_groups(params: Any) -> list[dict]:
    """Matrices at ``GROUP_LRS[0]``, vectors (biases, LayerNorm) at ``GROUP_LRS[1]``; by
    dimension, so it works on FSDP2's DTensors too."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "lr": GROUP_LRS[0]},
            {"params": [p for p in params if p.dim() < 2], "lr": GROUP_LRS[1]}]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(params), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


SF_KWARGS = {"lr": LR, "weight_decay": WEIGHT_DECAY, "warmup_steps": SF_WARMUP, "foreach": False}


def sf_adamw(params) -> torch.optim.Optimizer:
    import schedulefree

    return schedulefree.AdamWScheduleFree(param_groups(params), **SF_KWARGS)


def optimizer_for(controller: str) -> Callable[[Any], torch.optim.Optimizer]:
    return sf_adamw if controller == "schedulefree" else adamw


def sync_record(sched: Any) -> dict:
    """What a sync decided and scored, from the scheduler right after it (the same keys
    for the simulator and a rank)."""
    last = sched.last_sync
    groups = sched.num_groups
    return {"step": sched.step_count,
            "permutations": {f"{a}/{g}": list(p) for (a, g), p in sched.permutations.items()},
            "base": [sched.base_value("lr", g) for g in range(groups)],
            "applied": [list(sched.applied[("lr", g)]) for g in range(groups)],
            "fitness": [last.get(f"hdet/fitness/replica_{r}") for r in range(REPLICAS)],
            "loss": [last.get(f"hdet/loss/replica_{r}") for r in range(REPLICAS)],
            "weights": [last.get(f"hdet/weight/replica_{r}") for r in range(REPLICAS)],
            "delta": [last.get(f"hdet/lr/group_{g}/hypergradient", 0.0) for g in range(groups)],
            "tau_base": sched.base_value("temperature", 0) if "temperature" in sched.config.axes else None,
            "multiplier": [last.get(f"hdet/lr/group_{g}/multiplier") for g in range(groups)]}


class Recorder:
    """Per step: the LR of every group of this rank's optimizer for the coming step (and,
    with ``full``, the full parameters after the step); per sync: ``sync_record`` and the
    probe calls this rank made for it."""

    def __init__(self, sched: Any, groups: Callable[[], list], calls: list,
                 full: Callable[[], np.ndarray] | None = None, model: Any = None) -> None:
        self.sched, self.groups, self.calls, self.full = sched, groups, calls, full
        self.model = model
        self.taus: list[tuple[float, float]] = []  # (scheduler's value, the module's tau) per step
        self.lrs = [self._lrs()]
        self._tau()
        self.syncs: list[dict] = []
        self.steps: list[np.ndarray] = []
        self._seen = 0

    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.groups()]

    def _tau(self) -> None:
        if self.model is not None and "temperature" in self.sched.config.axes:
            from hdet_scale.model_axes import _root

            self.taus.append((self.sched.model_value("temperature"), _root(self.model).tau))

    def after_step(self) -> None:
        self.lrs.append(self._lrs())
        self._tau()
        if self.sched.step_count % SYNC == 0:
            self.syncs.append({**sync_record(self.sched), "probe_calls": self.calls[self._seen:]})
            self._seen = len(self.calls)
        if self.full is not None:
            self.steps.append(self.full())

    def result(self, params: np.ndarray, init: dict) -> dict:
        t = self.sched.topology
        return {"lrs": self.lrs, "syncs": self.syncs, "params": params, "steps": self.steps, "init": init,
                "taus": self.taus,
                "replica": t.replica_index, "shard": t.shard_index, "shard_size": t.shard_size}


def _probe(calls: list, shards: int) -> Callable[[Any], Any]:
    """This rank's probe: slice ``rank() % shards`` of ``shards`` (DDP: all rows)."""
    return rank_tools.make_probe(rank() % shards, shards, calls, d_in=D_IN, d_out=D_OUT)


def _init_record(model: Any, full: Callable[[], np.ndarray]) -> dict:
    """Right after initialize: the full parameters (``full``, collective on the shard
    group) and the output of this rank's forward pass on a fixed input (eval, no grad)."""
    params = full()
    out = rank_tools.eval_output(model, forward_input())
    return {"params": params, "forward": out}


class Checkpoints:
    """The schedule-free runs' mid-run checkpoint: ``save(step)`` writes one at
    ``SAVE_AT`` into ``root`` when ``root`` is set; ``load()`` restores it and returns the
    first step to run (1 without a ``resume`` root)."""

    def __init__(self, save: Callable[[str], Any], load: Callable[[str], Any], root: str | None,
                 resume: str | None) -> None:
        self._save, self._load, self.root, self.resume = save, load, root, resume

    def save(self, step: int) -> None:
        if self.root is not None and step == SAVE_AT:
            self._save(self.root)

    def load(self) -> int:
        if self.resume is None:
            return 1
        self._load(self.resume)
        return SAVE_AT + 1


def _finish(rec: Recorder, sched: Any, full: Callable[[], np.ndarray], init: dict) -> dict:
    """The record, with the evaluation point x of a schedule-free optimizer (the same
    as the parameters for AdamW)."""
    out = rec.result(full(), init)
    with sched.eval_mode():
        out["x"] = full()
    out["y_after_eval"] = full()  # back at the training point
    return out


def _run_torch(model: Any, opt: Any, sched: Any, data: Any, full: Any, calls: list, init: dict,
               steps: int, ckpt: Checkpoints | None = None) -> dict:
    rec = Recorder(sched, lambda: opt.param_groups, calls, full if steps < STEPS else None, model)
    start = ckpt.load() if ckpt else 1
    for step in range(start, steps + 1):
        x, y = data(step)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step(loss.detach())
        rec.after_step()
        if ckpt:
            ckpt.save(step)
    return _finish(rec, sched, full, init)


def _fsdp2_full(model: Any) -> np.ndarray:
    """Full parameters (collective on the shard group). A forward without backward leaves
    FSDP2's unsharded plain parameters registered: reshard first."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return flat_numpy(p.full_tensor() for p in model.parameters())


def run_fsdp2(mode: str, controller: str, warm: bool = False, steps: int = STEPS, root: str | None = None,
              resume: str | None = None) -> dict:
    from hdet_scale.backends import fsdp2

    calls: list = []
    model, opt, sched = fsdp2.initialize(build_model(), hdet_block(mode, controller, warm), optimizer_for(controller),
                                         shard_modules=lambda m: [m.fc1, m.fc2, m.head],
                                         probe=_probe(calls, SHARDS))
    g = rank()

    def full() -> np.ndarray:
        return _fsdp2_full(model)

    init = _init_record(model, full)
    ckpt = Checkpoints(lambda d: fsdp2.save_checkpoint(model, opt, sched, d),
                       lambda d: fsdp2.load_checkpoint(model, opt, sched, d), root, resume)
    return _run_torch(model, opt, sched, lambda t: batch(g, t), full, calls, init, steps, ckpt)


def run_fairscale(mode: str, controller: str, warm: bool = False, steps: int = STEPS, root: str | None = None,
                  resume: str | None = None) -> dict:
    from hdet_scale.backends import fairscale

    calls: list = []
    model = build_model()
    if warm:  # a frozen parameter: in no OSS bucket, whole on every rank (warm init's other path)
        model.norm.bias.requires_grad_(False)
    if controller == "schedulefree":
        import schedulefree

        optim, kwargs = schedulefree.AdamWScheduleFree, dict(SF_KWARGS)
    else:
        optim, kwargs = torch.optim.AdamW, {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": False}
    ddp, opt, sched = fairscale.initialize(model, hdet_block(mode, controller, warm), optim, kwargs,
                                           params=param_groups(model.parameters()), probe=_probe(calls, SHARDS))
    g = rank()

    def full() -> np.ndarray:
        return flat_numpy(ddp.module.parameters())

    init = _init_record(ddp, full)
    ckpt = Checkpoints(lambda d: fairscale.save_checkpoint(ddp, opt, sched, d),
                       lambda d: fairscale.load_checkpoint(ddp, opt, sched, d), root, resume)
    return _run_torch(ddp, opt, sched, lambda t: batch(g, t), full, calls, init, steps, ckpt)


def run_ddp(mode: str, controller: str, warm: bool = False, steps: int = STEPS, root: str | None = None,
            resume: str | None = None) -> dict:
    from hdet_scale.backends import ddp

    calls: list = []
    model, opt, sched = ddp.initialize(build_model(), hdet_block(mode, controller, warm), optimizer_for(controller),
                                       probe=_probe(calls, 1))
    r = rank()

    def full() -> np.ndarray:
        return flat_numpy(model.module.parameters())

    init = _init_record(model, full)
    ckpt = Checkpoints(lambda d: ddp.save_checkpoint(model, opt, sched, d),
                       lambda d: ddp.load_checkpoint(model, opt, sched, d), root, resume)
    return _run_torch(model, opt, sched, lambda t: replica_batch(r, t), full, calls, init, steps, ckpt)


def run_deepspeed(mode: str, controller: str, warm: bool = False, steps: int = STEPS, root: str | None = None,
                  resume: str | None = None, sub_group_size: int | None = None) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from hdet_scale import initialize

    model = build_model()
    # DeepSpeed 0.19 clips the gradient norm at 1.0 unless told otherwise
    # (GRADIENT_CLIPPING_DEFAULT); the other runs do not clip. The warm run partitions
    # the two larger matrices (threshold 100) and keeps the rest persistent, so warm init
    # must reach both kinds of working copy; the others keep every tensor persistent.
    zero: dict[str, Any] = {"stage": 3}
    if warm:
        zero["stage3_param_persistence_threshold"] = 100
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
           "hdet": hdet_block(mode, controller, warm)}
    calls: list = []
    engine, _, _, sched = initialize(model, cfg, optimizer=optimizer_for(controller)(model.parameters()),
                                     probe=_probe(calls, SHARDS))
    g = rank()
    params = list(engine.module.parameters())

    def full() -> np.ndarray:  # the working copy the forward reads (collective on the shard group)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return flat_numpy(params)

    init = _init_record(engine, full)
    init["master"] = flat_numpy(safe_get_full_fp32_param(p) for p in params)  # fp32 masters
    rec = Recorder(sched, lambda: engine.optimizer.param_groups, calls, full if steps < STEPS else None, engine)
    from hdet_scale.backends import deepspeed as ds_backend

    ckpt = Checkpoints(lambda d: ds_backend.save_checkpoint(engine, sched, d),
                       lambda d: ds_backend.load_checkpoint(engine, sched, d), root, resume)
    for step in range(ckpt.load(), steps + 1):
        x, y = batch(g, step)
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step(lr_kwargs={"loss": loss.detach()})
        rec.after_step()
        ckpt.save(step)
    return _finish(rec, sched, full, init)


SHARDED = {"fsdp2": run_fsdp2, "fairscale": run_fairscale, "deepspeed": run_deepspeed}


def _schedule_free_runs(fn: Callable, name: str, root: str, out: dict) -> None:
    """Schedule-free AdamW under HDET ("global" mode): the uninterrupted run (saving at
    ``SAVE_AT`` into ``root/<name>``), then a run resumed from that checkpoint."""
    ckpt = f"{root}/{name}"
    out[(name, "schedulefree", "global")] = fn("global", "schedulefree", root=ckpt)
    out[(name, "schedulefree-resumed", "global")] = fn("global", "schedulefree", resume=ckpt)


def launch_sharded(modes: list[str], root: str) -> dict:
    """4 ranks: FSDP2, fairscale OSS and DeepSpeed ZeRO-3 (2 x 2), each controller and
    gradient mode (12 steps), then a warm-init run of each (to the first converge), and
    the schedule-free runs (checkpoints under ``root``)."""
    warnings.filterwarnings("ignore")
    out = {}
    for controller in CONTROLLERS:
        for mode in modes:
            for name, fn in SHARDED.items():
                out[(name, controller, mode)] = fn(mode, controller)
    for name, fn in SHARDED.items():
        out[(name, "warm", WARM_MODE)] = fn(WARM_MODE, "log", warm=True, steps=SYNC)
        out[(name, "temperature", "global")] = fn("global", "temperature")
        _schedule_free_runs(fn, name, root, out)
    # ZeRO-3 splitting each parameter group into sub-groups of at most 100 elements
    out[("deepspeed", "schedulefree-subgroups", "global")] = run_deepspeed("global", "schedulefree", sub_group_size=100)
    return out


def launch_ddp(modes: list[str], root: str) -> dict:
    """2 ranks: DDP, one replica per rank, each controller and gradient mode, and a
    warm-init run to the first converge."""
    warnings.filterwarnings("ignore")
    out = {("ddp", c, m): run_ddp(m, c) for c in CONTROLLERS for m in modes}
    out[("ddp", "warm", WARM_MODE)] = run_ddp(WARM_MODE, "log", warm=True, steps=SYNC)
    out[("ddp", "temperature", "global")] = run_ddp("global", "temperature")
    _schedule_free_runs(run_ddp, "ddp", root, out)
    return out
