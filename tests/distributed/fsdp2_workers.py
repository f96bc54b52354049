"""Rank worker functions for tests/distributed/test_fsdp2.py (HDET on PyTorch FSDP2).

Spawned rank processes import this module by name (``fsdp2_workers``), so it must stay
importable from tests/distributed (conftest.py puts the folder on ``sys.path``). Each
worker runs on one of 4 gloo ranks (2 replicas x 2 shards), builds one or more
FSDP2 models and returns plain Python / numpy data (no torch tensors: they would travel
through shared memory that dies with the rank process); the test process compares ranks
and asserts.

Determinism: the model is initialised from a dedicated ``torch.Generator`` (seeded),
every rank's batch for step ``t`` comes from a generator seeded with ``(rank, t)``, and
no worker reads the global RNG for data, so a resumed run sees the same batches.
The helpers shared with the other backends' workers (seeded init, numpy conversion,
collective guards) live in ``rank_tools``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import REPLICAS, S, WORLD, buffer_arrays, hdet_block, lrs, rank, to_numpy

D_IN, D_HIDDEN, D_MID, D_OUT, MICRO = 8, 16, 3, 1, 2
LR = 1e-2


# ---- model, data, config -------------------------------------------------------------

class TinyNet(torch.nn.Module):
    """Linear(8, 16) (even shards over S = 2), LayerNorm(16), Linear(16, 3) (uneven:
    2 + 1 rows), Linear(3, 1) (dim 0 of size 1: shard 1 holds empty weight and bias),
    plus a persistent float buffer, a running mean of the inputs seen in training (like
    BatchNorm statistics; FSDP2 never syncs it, so it differs on every rank and converge
    must average it). The buffer does not enter the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_HIDDEN)
        self.norm = torch.nn.LayerNorm(D_HIDDEN)
        self.fc2 = torch.nn.Linear(D_HIDDEN, D_MID)
        self.head = torch.nn.Linear(D_MID, D_OUT)
        self.register_buffer("input_mean", torch.zeros(D_IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.input_mean.mul_(0.9).add_(x.mean(0).to(self.input_mean.dtype), alpha=0.1)
        h = F.gelu(self.norm(self.fc1(x)))       # (B, 16)
        h = torch.tanh(self.fc2(h))              # (B, 3)
        return self.head(h)                      # (B, 1)


def build_model(seed: int = 0) -> TinyNet:
    """Same weights on every rank for a given seed, without touching the global RNG."""
    return rank_tools.seeded_model(TinyNet, seed)


def shard_blocks(model: TinyNet) -> list[torch.nn.Module]:
    return [model.fc1, model.fc2]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for optimizer step ``step`` (1-based), from its own generator."""
    return rank_tools.seeded_batch(10_000 + 1_000 * rank + step, MICRO, D_IN, D_OUT)


def probe_input() -> torch.Tensor:
    return rank_tools.probe_input(D_IN)


def make_optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def init(config: Any, *, bf16: bool = False, reshard: bool | None = None, seed: int = 0, probe: Any = None):
    from hdet_scale.backends.fsdp2 import initialize
    return initialize(build_model(seed), config, make_optimizer, shard_modules=shard_blocks,
                      mp_policy=bf16_policy() if bf16 else None, reshard_after_forward=reshard, probe=probe)


# ---- reading a model -------------------------------------------------------------------

def reshard(model) -> None:
    """Register the sharded DTensor parameters again (a forward without backward leaves
    full-size plain parameters registered on unsharded modules). No communication."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_shards(model) -> np.ndarray:
    """This rank's local parameter shards, flat, module order (no communication)."""
    reshard(model)
    with torch.no_grad():
        return rank_tools.flat_numpy(p.to_local() for p in model.parameters())


def local_numels(model) -> dict[str, int]:
    reshard(model)
    with torch.no_grad():
        return {n: p.to_local().numel() for n, p in model.named_parameters()}


def full_params(model) -> np.ndarray:
    """Full parameters, flat, module order. Collective on the parameters' mesh."""
    reshard(model)
    with torch.no_grad():
        return rank_tools.flat_numpy(p.full_tensor() for p in model.parameters())


def adam_state(optimizer) -> dict[str, np.ndarray]:
    """Local shards of every Adam moment and the step counters, flat per kind."""
    out: dict[str, list] = {"exp_avg": [], "exp_avg_sq": [], "step": []}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                for k, values in out.items():
                    v = st[k]
                    values.append(to_numpy(v.to_local() if hasattr(v, "to_local") else v))
    return {k: np.concatenate(v) for k, v in out.items()}


def probe(model) -> np.ndarray:
    """Output of a forward pass on a fixed input, eval mode (buffers untouched), no
    grad: FSDP2 then keeps the root's unsharded parameters (no backward reshards them),
    and, with reshard_after_forward=False, every module's."""
    return rank_tools.eval_output(model, probe_input())


def train_step(model, opt, sched, step: int) -> float:
    x, y = batch(rank(), step)
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step(loss)
    return float(loss.detach())


def capture_converge(model, opt, sched, store: list) -> None:
    """Wrap the sync object's converge: record the local shards and buffers it is about
    to average (after the sync step's own optimizer update), then converge."""
    rank_tools.capture_converge(sched, store, lambda: {"local": local_shards(model), "buffers": buffer_arrays(model),
                                                       "adam": adam_state(opt)})


def sched_state(sched) -> dict:
    return {**rank_tools.sched_state(sched), "sync_count": sched.sync_count}


def record_collectives(calls: list):
    """Context manager: record ``(name, ranks of the group)`` of every ``torch.distributed``
    collective called through the module (as FSDP2's eager collectives are)."""
    import torch.distributed as dist

    def wrap(mod, name, f):
        def g(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, sorted(dist.get_process_group_ranks(group)) if group is not None else "WORLD"))
            return f(*args, **kwargs)
        return g

    return rank_tools.patched_collectives(wrap)


# ---- 1, 2. converge: identity, mean, uneven/empty shards, bf16, stale copies -----------

CONVERGE_CASES = {
    # name: (bf16 mixed precision, gradient_sharing, reshard_after_forward, config form).
    # reshard_after_forward None (FSDP2's default) keeps the root unsharded after a
    # forward, False every module, True none.
    "fp32_global": (False, "global", None, "block"),
    "bf16_global_keep": (True, "global", False, "deepspeed"),
    "bf16_replica": (True, "replica", None, "json"),
    "fp32_replica_reshard": (False, "replica", True, "object"),
}


def _config(form: str, block: dict, tmp: str) -> Any:
    if form == "block":
        return block
    if form == "deepspeed":
        return {"train_micro_batch_size_per_gpu": MICRO, "hdet": block}
    if form == "json":
        path = os.path.join(tmp, "ds.json")
        with open(path, "w") as f:
            json.dump({"hdet": block}, f)
        return path
    from hdet_scale.config import HDETConfig
    return HDETConfig.from_dict(block)


def converge_worker() -> dict:
    """Per case: spread 0.5, sync every 3 steps. Steps 1-3 (the sync inside step 3's
    scheduler.step, local shards captured right before converge), then a forward; then
    steps 4-5, a no-grad forward (leaving unsharded copies), a converge by hand
    (``scheduler.converge()``) and a forward again."""
    out = {}
    for name, (bf16, sharing, reshard, form) in CONVERGE_CASES.items():
        with tempfile.TemporaryDirectory(prefix=f"hdet_fsdp2_rank{rank()}_") as tmp:
            model, opt, sched = init(_config(form, hdet_block(gradient_sharing=sharing), tmp), bf16=bf16,
                                     reshard=reshard)
        captured: list = []
        capture_converge(model, opt, sched, captured)
        w = model.fc1.weight
        res: dict[str, Any] = {"mesh": list(w.device_mesh.mesh_dim_names), "placements": str(w.placements),
                               "param_dtype": str(w.dtype), "numels": local_numels(model), "lrs": [],
                               "shares_gradients": sched.sync_obj.backend.shares_gradients}
        for step in (1, 2, 3):
            res["lrs"].append(lrs(opt))
            train_step(model, opt, sched, step)
        res["captured"] = captured[:]
        # Unwrap: the capture reshards (through local_shards), which would hide the
        # unsharded copies that the hand converge below must cope with by itself.
        del sched.sync_obj.converge
        res["sync_step"] = sched.last_sync.get("hdet/step")
        res["post_local"] = local_shards(model)
        res["post_buffers"] = buffer_arrays(model)
        res["post_probe"] = probe(model)  # before full_tensor(): the forward does its own all-gather
        res["post_full"] = full_params(model)
        for step in (4, 5):
            train_step(model, opt, sched, step)
        res["pre2_local"] = local_shards(model)
        res["pre2_probe"] = probe(model)  # leaves unsharded copies of the pre-converge weights
        res["unsharded_at_converge"] = [n for n, p in model.named_parameters() if not hasattr(p, "to_local")]
        sched.converge()
        res["post2_probe"] = probe(model)  # first: the helpers below reshard
        res["post2_local"] = local_shards(model)
        res["post2_full"] = full_params(model)
        out[name] = res
    return out


# ---- 3, 4. equivalence with plain FSDP2; what crosses replica groups; optimizer state ---

def _plain(mesh, steps: int) -> list[np.ndarray]:
    from torch.distributed.fsdp import fully_shard
    model = build_model()
    for m in shard_blocks(model):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(list(model.parameters()))
    params = []
    for step in range(1, steps + 1):
        x, y = batch(rank(), step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        params.append(full_params(model))
    return params


def equivalence_worker(steps: int = 7, replica_steps: int = 5) -> dict:
    """Plain FSDP2 over all 4 ranks (1-D mesh, dp = 4), plain HSDP on a 2 x 2 mesh, and
    plain FSDP2 on each replica's 2 ranks with its own data, all built here without
    hdet_scale; then HDET with spread
    0 and auto-LR off in "global" mode (syncs at 3, 6) and in "replica" mode (sync
    interval longer than the run, every collective recorded); then spread 0.5 in both
    modes with the Adam state recorded around the step-3 converge."""
    from torch.distributed.device_mesh import init_device_mesh
    rank_tools.init_dist()
    grid = init_device_mesh("cpu", (REPLICAS, S), mesh_dim_names=("rep", "dp"))
    out: dict[str, Any] = {"plain4": _plain(init_device_mesh("cpu", (WORLD,)), steps),
                           "plain_hsdp": _plain(grid, steps), "plain2": _plain(grid["dp"], replica_steps)}

    zero = {"lr": {"spread_ratio": 0.0}}
    model, opt, sched = init(hdet_block(gradient_sharing="global", axes=zero))
    out["global"], out["global_local"], out["global_syncs"], out["global_lrs"] = [], [], [], []
    for step in range(1, steps + 1):
        out["global_lrs"].append(lrs(opt))
        train_step(model, opt, sched, step)
        out["global"].append(full_params(model))
        out["global_local"].append(local_shards(model))
        out["global_syncs"].append(sched.sync_count)

    model, opt, sched = init(hdet_block(gradient_sharing="replica", axes=zero, sync_interval=100))
    out["replica"], calls = [], []
    for step in range(1, replica_steps + 1):
        with record_collectives(calls):
            train_step(model, opt, sched, step)
        out["replica"].append(full_params(model))
    out["replica_calls"] = sorted({(n, tuple(g) if isinstance(g, list) else g) for n, g in calls})
    out["replica_syncs"] = sched.sync_count

    for sharing in ("global", "replica"):
        model, opt, sched = init(hdet_block(gradient_sharing=sharing))
        captured: list = []
        capture_converge(model, opt, sched, captured)
        hist = []
        for step in range(1, 5):
            train_step(model, opt, sched, step)
            hist.append({"adam": adam_state(opt), "local": local_shards(model), "lrs": lrs(opt)})
        out[f"spread_{sharing}"] = {"hist": hist, "captured": captured}
    return out


# ---- 5. exact resume ---------------------------------------------------------------------

RESUME_STEPS, RESUME_AT = 8, 5
# name: (gradient_sharing, bf16 mixed precision, reshard_after_forward, save step)
RESUME_CASES = {"global_bf16": ("global", True, False, RESUME_AT), "replica_fp32": ("replica", False, None, RESUME_AT),
                "replica_fp32_step0": ("replica", False, None, 0)}


def _resume_hdet(sharing: str, replicas: int = REPLICAS) -> dict:
    return hdet_block(replicas=replicas, gradient_sharing=sharing, axes={"lr": {"spread_ratio": 0.3}},
                      schedule={"name": "onecycle", "total_steps": 10},
                      auto={"enabled": True, "warmup_steps": 3})  # default: "log", scored by the probe


def _snapshot(model, opt, sched) -> dict:
    return {"local": local_shards(model), "buffers": buffer_arrays(model), "adam": adam_state(opt),
            "sched": sched_state(sched), "probe": probe(model), "full": full_params(model)}


def _run(model, opt, sched, first: int, last: int, used_lrs: dict) -> None:
    for step in range(first, last + 1):
        used_lrs[step] = lrs(opt)
        train_step(model, opt, sched, step)


def resume_worker(ckpt_root: str) -> dict:
    """Per case: A: 8 steps uninterrupted. B: fresh model, steps up to the save step
    (5: mid-interval, syncs at 3 and 6; or 0: before any optimizer state exists), save,
    and (step-0 case) go on to step 8 (saving must not change the run). C: fresh model
    from *other* initial weights, load, go on to step 8. Then D: a 4 x 1 layout must
    refuse the checkpoint before any collective."""
    from hdet_scale.backends.fsdp2 import load_checkpoint, save_checkpoint
    from hdet_scale.errors import HDETStateError
    out: dict[str, Any] = {}
    probe = rank_tools.rank_probe(d_in=D_IN, d_out=D_OUT)
    for name, (sharing, bf16, reshard, at) in RESUME_CASES.items():
        cfg = _resume_hdet(sharing)
        ckpt = os.path.join(ckpt_root, name)
        res: dict[str, Any] = {"A_lrs": {}, "B_lrs": {}, "C_lrs": {}}

        model, opt, sched = init(cfg, bf16=bf16, reshard=reshard, probe=probe)
        _run(model, opt, sched, 1, RESUME_STEPS, res["A_lrs"])
        res["A"] = _snapshot(model, opt, sched)

        model, opt, sched = init(cfg, bf16=bf16, reshard=reshard, probe=probe)
        _run(model, opt, sched, 1, at, res["B_lrs"])
        res["B_at_save"] = {"local": local_shards(model), "adam": adam_state(opt) if opt.state else None,
                            "loss_count": sched.sync_obj.state_dict()["loss_count"]}
        res["tag"] = save_checkpoint(model, opt, sched, ckpt)
        if at == 0:
            _run(model, opt, sched, 1, RESUME_STEPS, res["B_lrs"])
            res["B"] = _snapshot(model, opt, sched)

        model, opt, sched = init(cfg, bf16=bf16, reshard=reshard, seed=1, probe=probe)
        res["C_before_load"] = local_shards(model)
        load_checkpoint(model, opt, sched, ckpt)
        res["C_after_load"] = {"local": local_shards(model), "adam": adam_state(opt) if opt.state else None,
                               "step": sched.step_count, "loss_count": sched.sync_obj.state_dict()["loss_count"]}
        _run(model, opt, sched, at + 1, RESUME_STEPS, res["C_lrs"])
        res["C"] = _snapshot(model, opt, sched)
        res["files"] = sorted(rank_tools.files_under(ckpt))
        out[name] = res

    model, opt, sched = init(_resume_hdet("replica", replicas=4), probe=probe)
    t0 = time.monotonic()
    out["D_error"] = rank_tools.error_text(
        lambda: load_checkpoint(model, opt, sched, os.path.join(ckpt_root, "replica_fp32")),
        (HDETStateError, AssertionError))
    out["D_seconds"] = time.monotonic() - t0

    # E: a model without the head (a smaller model) loading that checkpoint: refused on every
    # rank alike before anything is loaded (DCP alone loaded the keys it was asked for)
    from hdet_scale.backends.fsdp2 import initialize
    model, opt, sched = initialize(rank_tools.seeded_model(HeadlessNet, 0), _resume_hdet("replica"), make_optimizer,
                                   shard_modules=shard_blocks, probe=probe)
    before = local_shards(model)
    try:
        load_checkpoint(model, opt, sched, os.path.join(ckpt_root, "replica_fp32"))
        out["E_error"] = None
    except HDETStateError as e:
        out["E_error"] = str(e)
    out["E_unchanged"] = bool(np.array_equal(before, local_shards(model)))
    return out


class HeadlessNet(TinyNet):
    """TinyNet without its head: a smaller model than the one resume_worker saves."""

    def __init__(self) -> None:
        super().__init__()
        del self.head


# ---- 6. bad configs fail on every rank, before any collective ----------------------------

BAD_CONFIGS = {
    "replicas": lambda: hdet_block(replicas=3),
    "spread_ratio": lambda: hdet_block(axes={"lr": {"spread_ratio": 1.5}}),
    "unknown_key": lambda: hdet_block(sync_intervall=3),
    "disabled": lambda: hdet_block(enabled=False),
}


def training_worker() -> dict:
    """One launch for everything but resume (a 4-rank start costs ~10 s on 2 cores): the
    bad configs first (they need torch.distributed not yet initialised), then converge,
    then the equivalence runs."""
    return {"bad": bad_config_worker(), "converge": converge_worker(), "equivalence": equivalence_worker()}


def bad_config_worker() -> dict:
    """Every bad config first with torch.distributed not yet initialised (initialize
    would start it from the launcher's environment), then again after initialising it
    (as a launcher script may): each must raise HDETConfigError on this rank by itself;
    a rank left waiting in a collective would trip the harness deadline."""
    import torch.distributed as dist
    from hdet_scale.backends.fsdp2 import initialize
    from hdet_scale.errors import HDETConfigError
    out: dict[str, Any] = {}
    for phase in ("before_init", "after_init"):
        if phase == "after_init":
            dist.init_process_group("gloo")
        for case, make in BAD_CONFIGS.items():
            try:
                initialize(build_model(), make(), make_optimizer)
                out[f"{phase}/{case}"] = "accepted"
            except HDETConfigError as e:
                out[f"{phase}/{case}"] = f"HDETConfigError: {e}"
        out[f"{phase}/dist_initialized"] = dist.is_initialized()
    return out
