"""Rank worker functions for tests/distributed/test_fairscale.py (HDET on fairscale OSS +
torch DDP).

Spawned rank processes import this module by name (``fairscale_workers``; conftest.py puts
tests/distributed on ``sys.path``). Each worker runs on one of 4 gloo ranks (2 replicas x 2
shards: ranks 0, 1 = replica 0, ranks 2, 3 = replica 1) and returns plain Python / numpy
data; the test process compares ranks and asserts.

Determinism: the model is initialised from a dedicated seeded ``torch.Generator``, every
rank's batch for step ``t`` comes from a generator seeded with ``(rank, t)``, and no
worker reads the global RNG, so a resumed run sees the same batches. The helpers shared
with the other backends' workers (seeded init, numpy conversion, collective and
checkpoint-write guards) live in ``rank_tools``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np
import rank_tools
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rank_tools import REPLICAS, S, buffer_arrays, hdet_block, init_dist, lrs, to_numpy

# The model, data and probe are the buffered MLP shared with the other worker module.
from rank_tools import (D_HIDDEN, D_IN, D_OUT, LR, MICRO, TinyNet, batch, build_model,  # noqa: F401
                        probe_input, rank)


# ---- reading a rank ---------------------------------------------------------------------

def module_of(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def params(model: torch.nn.Module) -> np.ndarray:
    """Full parameters of this rank (flat float32, module order)."""
    return rank_tools.flat_numpy(module_of(model).parameters())


def grads(model: torch.nn.Module) -> np.ndarray:
    return rank_tools.flat_numpy(p.grad for p in module_of(model).parameters())


def buffers(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return buffer_arrays(module_of(model))


def probe(model: torch.nn.Module) -> np.ndarray:
    """Output of the next forward pass on a fixed input (eval mode: buffers untouched)."""
    return rank_tools.eval_output(module_of(model), probe_input())


def inner_state(opt) -> dict[int, dict[str, np.ndarray]]:
    """The inner (sharded) optimizer's state on this rank, keyed by the parameter's index
    in ``module.parameters()`` order."""
    index = {id(p): i for i, p in enumerate(opt._hdet_module.parameters())}
    out = {}
    for p, st in opt.optim.state.items():
        out[index[id(p)]] = {k: to_numpy(v) if torch.is_tensor(v) else np.array(float(v)) for k, v in st.items()}
    return out


def inner_groups(opt) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in opt.optim.param_groups]


def train_step(model, opt, sched, step: int) -> float:
    """The user's loop: forward, backward, optimizer.step, zero_grad, scheduler.step(loss)."""
    x, y = batch(rank(), step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step(loss)
    return float(loss.detach())


def hdet_init(cfg: dict, seed: int = 0, optim=torch.optim.AdamW, optim_kwargs: dict | None = None, **kwargs):
    from hdet_scale.backends.fairscale import initialize
    model = build_model(seed)
    ddp, opt, sched = initialize(model, cfg, optim, optim_kwargs or {"lr": LR, "weight_decay": 0.01}, **kwargs)
    opt._hdet_module = model  # lets inner_state name parameters by module index
    return ddp, opt, sched


@contextlib.contextmanager
def count_collectives(store: dict):
    """Count elements passed to dist.all_reduce / dist.broadcast inside the block (every
    caller reaches them through the ``torch.distributed`` module attribute)."""
    saved = dist.all_reduce, dist.broadcast

    def counter(name: str, fn):
        def f(*a, **k):
            t = a[0] if a else k["tensor"]
            store[name] = store.get(name, 0) + t.numel()
            return fn(*a, **k)
        return f

    all_reduce, broadcast = counter("all_reduce", saved[0]), counter("broadcast", saved[1])

    dist.all_reduce, dist.broadcast = all_reduce, broadcast
    try:
        yield
    finally:
        dist.all_reduce, dist.broadcast = saved


def capture_converge(model, opt, sched, store: list) -> None:
    """Wrap the sync object's converge: record what it is about to average (after the
    sync step's own optimizer update), then count its communication."""
    rank_tools.capture_converge(
        sched, store, lambda: {"params": params(model), "buffers": buffers(model), "state": inner_state(opt),
                               "comm": {}},
        during=lambda record: count_collectives(record["comm"]))


# ---- converge, equivalence, isolation, hyperparameter propagation ------------------------

def _converge_case(sharing: str) -> dict:
    """Spread 0.5, constant LR, sync at step 3 (inside scheduler.step)."""
    model, opt, sched = hdet_init(hdet_block(gradient_sharing=sharing))
    captured: list = []
    capture_converge(model, opt, sched, captured)
    res: dict[str, Any] = {"lrs": [], "replica": sched.topology.replica_index}
    for step in (1, 2):
        res["lrs"].append(lrs(opt))
        train_step(model, opt, sched, step)
    res["pre_params"], res["pre_probe"] = params(model), probe(model)
    res["lrs"].append(lrs(opt))
    train_step(model, opt, sched, 3)
    res["captured"] = captured
    res["post_probe"], res["post_params"], res["post_buffers"] = probe(model), params(model), buffers(model)
    res["post_state"] = inner_state(opt)
    res["owned_numel"] = sum(b.numel() for b in opt.optim.param_groups[0]["params"])
    res["total_numel"] = sum(p.numel() for p in model.module.parameters())
    res["sync_step"] = sched.last_sync.get("hdet/step")
    return res


def _equivalence(steps: int = 7) -> dict:
    """Plain torch DDP over all 4 ranks + torch AdamW, then HDET (global, spread 0, auto
    off, syncs at 3 and 6) on the same initial weights and per-rank batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    out: dict[str, Any] = {"plain": [], "hdet": [], "syncs": []}
    model = DDP(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(1, steps + 1):
        train_step(model, opt, None, step)
        out["plain"].append(params(model))
    model, opt, sched = hdet_init(hdet_block(axes={"lr": {"spread_ratio": 0.0}}))
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step)
        out["hdet"].append(params(model))
        out["syncs"].append(sched.sync_count)
    out["state"] = inner_state(opt)
    out["state_numel"] = sum(v.size for st in out["state"].values() for k, v in st.items() if k != "step")
    out["param_numel"] = [p.numel() for p in model.module.parameters()]
    return out


def _isolation(steps: int = 5) -> dict:
    """HDET "replica" sharing, spread 0.5, no sync within ``steps``; then, per replica, a
    plain torch DDP over that replica's 2 ranks (its own process group) + torch AdamW at
    the LR HDET gave the replica, from the same initial weights on the same batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, opt, sched = hdet_init(hdet_block(gradient_sharing="replica", sync_interval=50))
    out: dict[str, Any] = {"lrs": [], "hdet": []}
    for step in range(1, steps + 1):
        out["lrs"].append(lrs(opt))
        train_step(model, opt, sched, step)
        out["hdet"].append(params(model))
    out["syncs"] = sched.sync_count
    groups = [dist.new_group([r * S + s for s in range(S)]) for r in range(REPLICAS)]  # collective, same order
    lr = out["lrs"][0][0]
    model = DDP(build_model(), process_group=groups[rank() // S])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    out["plain"] = []
    for step in range(1, steps + 1):
        train_step(model, opt, None, step)
        out["plain"].append(params(model))
    return out


def _record_inner_step(opt, store: list) -> None:
    """Record the inner optimizer's param groups (what the update really uses) at each
    inner step, after OSS copied the outer groups into it."""
    inner = opt.optim
    original = inner.step

    def step(*a, **k):
        store.append(inner_groups(opt))
        return original(*a, **k)

    inner.step = step


def _sgd_update_size() -> dict:
    """Plain SGD (no momentum, no decay), two parameter groups with peak LRs 0.01 and
    0.02, spread 0.5, global gradients: each step's update must be -lr_r,g * grad."""
    model = build_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    from hdet_scale.backends.fairscale import initialize
    ddp, opt, sched = initialize(model, hdet_block(), torch.optim.SGD, {"lr": LR},
                                 params=[{"params": weights}, {"params": others, "lr": 2 * LR}])
    inner: list = []
    _record_inner_step(opt, inner)
    names = [n for n, _ in model.named_parameters()]
    group_of = [0 if n.endswith("weight") else 1 for n in names]
    out: dict[str, Any] = {"steps": [], "group_of_param": [group_of[i] for i, p in enumerate(model.parameters())
                                                              for _ in range(p.numel())]}
    for step in range(1, 5):
        x, y = batch(rank(), step)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        before, g, outer = params(ddp), grads(ddp), lrs(opt)
        opt.step()
        out["steps"].append({"before": before, "grad": g, "outer_lrs": outer, "after": params(ddp),
                             "inner": inner[-1]})
        opt.zero_grad()
        sched.step(loss)
    out["replica"] = sched.topology.replica_index
    return out


def _cycle_momentum(steps: int = 8) -> dict:
    """OneCycle with cycle_momentum (AdamW beta1), spread 0.5, sync every 4 steps: the
    inner optimizer's lr and betas at every step; compared in the test with torch's
    OneCycleLR."""
    cfg = hdet_block(sync_interval=4, schedule={"name": "onecycle", "total_steps": 20, "cycle_momentum": True})
    model, opt, sched = hdet_init(cfg)
    inner: list = []
    _record_inner_step(opt, inner)
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step)
    return {"inner": inner, "replica": sched.topology.replica_index}


# ---- exact resume ---------------------------------------------------------------------------

RESUME_STEPS, RESUME_AT = 8, 4


def resume_cfg(sharing: str) -> dict:
    return hdet_block(gradient_sharing=sharing, axes={"lr": {"spread_ratio": 0.3}},
                      schedule={"name": "onecycle", "total_steps": 10, "cycle_momentum": True},
                      auto={"enabled": True, "warmup_steps": 3})  # default: "log", scored by the probe


def snapshot(model, opt, sched) -> dict:
    return {"params": params(model), "buffers": buffers(model), "state": inner_state(opt),
            "inner_groups": inner_groups(opt), "outer_lrs": lrs(opt),
            "sched": {**rank_tools.sched_state(sched), "sync": sched.sync_obj.state_dict()}}


def _resume_case(ckpt_dir: str, sharing: str, ddp_kwargs: dict | None = None) -> dict:
    """A: 8 steps uninterrupted. B: fresh, 4 steps (between the syncs at 3 and 6), save.
    C: fresh from *other* initial weights, load, steps 5-8. Auto-LR from step 3."""
    from hdet_scale.backends.fairscale import load_checkpoint, save_checkpoint
    cfg = resume_cfg(sharing)
    kw = {"ddp_kwargs": ddp_kwargs, "probe": rank_tools.rank_probe()}
    out: dict[str, Any] = {}

    def run(model, opt, sched, first: int, last: int, key: str) -> None:
        hist = out.setdefault(f"{key}_lrs", {})
        for step in range(first, last + 1):
            hist[step] = lrs(opt)
            train_step(model, opt, sched, step)

    model, opt, sched = hdet_init(cfg, **kw)
    run(model, opt, sched, 1, RESUME_STEPS, "A")
    out["A"] = snapshot(model, opt, sched)

    model, opt, sched = hdet_init(cfg, **kw)
    run(model, opt, sched, 1, RESUME_AT, "B")
    out["B_at_save"] = snapshot(model, opt, sched)
    written: list = []
    with rank_tools.record_writes(ckpt_dir, written):
        out["tag"] = save_checkpoint(model, opt, sched, ckpt_dir)
    out["written"] = written

    model, opt, sched = hdet_init(cfg, seed=1, **kw)
    out["C_before_load"] = params(model)
    # a local load, but for the verdict of the checksum check every load runs first
    # (checkpoint_io.verify_checksums: one all_gather_object on the world group)
    with rank_tools.no_collectives(allow=("all_gather_object",)):
        load_checkpoint(model, opt, sched, ckpt_dir)
    out["C_after_load"] = snapshot(model, opt, sched)
    run(model, opt, sched, RESUME_AT + 1, RESUME_STEPS, "C")
    out["C"] = snapshot(model, opt, sched)
    return out


RESUME_CASES = {"replica": ("replica", None), "global": ("global", None),
                # DDP never rebuilds its gradient buckets with find_unused_parameters
                "global_no_rebuild": ("global", {"find_unused_parameters": True})}


def _resume(root: str) -> dict:
    from hdet_scale.backends.fairscale import load_checkpoint
    from hdet_scale.errors import HDETStateError
    out: dict[str, Any] = {name: _resume_case(os.path.join(root, name), *case) for name, case in RESUME_CASES.items()}
    model, opt, sched = hdet_init({**resume_cfg("replica"), "replicas": 4}, probe=rank_tools.rank_probe())  # 4 x 1
    out["layout_error"] = rank_tools.error_text(
        lambda: load_checkpoint(model, opt, sched, os.path.join(root, "replica")), (HDETStateError, AssertionError))
    return out


# ---- errors raised on every rank without a hang ----------------------------------------------

def _fairscale_fsdp_forward_error() -> str:
    """Wrap a model in fairscale's FullyShardedDataParallel on the gloo world group and run
    one forward: the failure hdet_scale refuses up front."""
    from fairscale.nn import FullyShardedDataParallel
    fsdp = FullyShardedDataParallel(build_model(), compute_device=torch.device("cpu"))
    try:
        fsdp(probe_input())
    except Exception as e:  # noqa: BLE001 (the observed failure, whatever it is, goes to the test)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _error_cases() -> dict:
    from fairscale.nn import FullyShardedDataParallel, ShardedDataParallel
    from fairscale.optim import OSS
    from torch.nn.parallel import DistributedDataParallel as DDP

    def nested_fsdp():
        model = build_model()
        model.fc2 = FullyShardedDataParallel(model.fc2, compute_device=torch.device("cpu"))
        return model, hdet_block()

    def sharded_ddp():
        model = build_model()
        return ShardedDataParallel(model, OSS(model.parameters(), lr=LR)), hdet_block()

    return {
        "fsdp": lambda: (FullyShardedDataParallel(build_model(), compute_device=torch.device("cpu")), hdet_block()),
        "nested_fsdp": nested_fsdp,
        "sharded_ddp": sharded_ddp,
        "torch_ddp": lambda: (DDP(build_model()), hdet_block()),
        "spread_ratio": lambda: (build_model(), hdet_block(axes={"lr": {"spread_ratio": 1.5}})),
        "replicas": lambda: (build_model(), hdet_block(replicas=3)),
        "unknown_key": lambda: (build_model(), hdet_block(sync_intervall=3)),
        "gradient_sharing": lambda: (build_model(), hdet_block(gradient_sharing="shard")),
        "ddp_process_group": lambda: (build_model(), hdet_block()),
    }


ERROR_CASES = ("fsdp", "nested_fsdp", "sharded_ddp", "torch_ddp", "spread_ratio", "replicas", "unknown_key",
               "gradient_sharing", "ddp_process_group")


def _errors() -> dict:
    """Every case must raise by itself on every rank, with no collective (the block
    forbids them); the fairscale FSDP forward failure is recorded first."""
    from hdet_scale.backends.fairscale import initialize
    out: dict[str, Any] = {"forward_error": _fairscale_fsdp_forward_error(), "cases": {}, "seconds": {}}
    cases = _error_cases()
    for name in ERROR_CASES:
        model, cfg = cases[name]()  # wrapper construction may communicate: outside the check
        ddp_kwargs = {"process_group": dist.group.WORLD} if name == "ddp_process_group" else None
        t0 = time.monotonic()
        # any error type is reported to the test, which checks it
        out["cases"][name] = rank_tools.error_text(
            lambda: initialize(model, cfg, torch.optim.AdamW, {"lr": LR}, ddp_kwargs=ddp_kwargs)) or "no error"
        out["seconds"][name] = time.monotonic() - t0
    return out


# ---- the launch ------------------------------------------------------------------------------

def all_worker(root: str) -> dict:
    """Every check in one launch of 4 ranks (process start-up dominates the cost). A
    section that raises is reported as its traceback; the others still run, unless the
    failure leaves the other ranks waiting in a collective (the harness deadline fires)."""
    import traceback
    init_dist()  # as under a launcher: initialize must cope with an existing group
    sections = {
        "converge": lambda: {m: _converge_case(m) for m in ("global", "replica")},
        "equivalence": _equivalence,
        "isolation": _isolation,
        "sgd": _sgd_update_size,
        "momentum": _cycle_momentum,
        "resume": lambda: _resume(root),
        "errors": _errors,
    }
    out: dict[str, Any] = {"seconds": {}}
    for name, fn in sections.items():
        t0 = time.monotonic()
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 (a failing section is reported, the others still run)
            out[name] = {"error": traceback.format_exc()}
        out["seconds"][name] = time.monotonic() - t0
    return out
