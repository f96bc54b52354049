"""Rank worker functions for tests/distributed/test_deepspeed.py (HDET on DeepSpeed ZeRO-3).

Spawned rank processes import this module by name (``ds_workers``), so it must stay
importable from tests/distributed (conftest.py puts the folder on ``sys.path``). Each worker
runs on one of 4 gloo ranks (2 replicas x 2 shards), drives one or more DeepSpeed
engines and returns plain Python / numpy data (no torch tensors: they would travel
through shared memory that dies with the rank process); the test process compares
ranks and asserts.

Determinism: the model is initialised from a dedicated ``torch.Generator`` (seeded),
every rank's batch for step ``t`` comes from a generator seeded with ``(rank, t)``, and
no worker reads the global RNG for data, so a resumed run sees the same batches.
The helpers shared with the other backends' workers (seeded init, numpy conversion,
collective and checkpoint-write guards) live in ``rank_tools``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import rank_tools
import torch
import torch.nn.functional as F
from rank_tools import clean_record, hdet_block, lrs, rank, sched_state, to_numpy

# The model, data and probe are the buffered MLP shared with the other worker module.
from rank_tools import (D_HIDDEN, D_IN, D_OUT, LR, MICRO, TinyNet, batch, build_model,  # noqa: F401
                        probe_input)


def ds_config(hdet: dict | None = None, *, bf16: bool = False, threshold: int | None = None,
              lr: float = LR) -> dict:
    """DeepSpeed ZeRO-3 config, AdamW; ``threshold`` None keeps DeepSpeed's default
    ``stage3_param_persistence_threshold`` (1e5: every tensor of TinyNet is persistent)."""
    zero: dict[str, Any] = {"stage": 3}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if hdet is not None:
        cfg["hdet"] = hdet
    return cfg


# ---- reading an engine -----------------------------------------------------------------

def full_master(engine) -> np.ndarray:
    """Full fp32 master parameters (flat, module order). Collective on the shard group."""
    from deepspeed.utils import safe_get_full_fp32_param
    return rank_tools.flat_numpy(safe_get_full_fp32_param(p) for p in engine.module.parameters())


def full_working(engine) -> tuple[np.ndarray, str]:
    """Full working-copy parameters (what forward reads: bf16 or fp32) as float32, and
    their dtype. Collective on the shard group."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return rank_tools.flat_numpy(params), str(params[0].dtype)


def buffers(engine) -> dict[str, tuple[np.ndarray, str]]:
    return {n: (to_numpy(b), str(b.dtype)) for n, b in engine.module.named_buffers()}


def probe(engine, dtype: torch.dtype) -> np.ndarray:
    """Output of the next forward pass on a fixed input (eval mode: buffers untouched)."""
    return rank_tools.eval_output(engine, probe_input().to(dtype))


def train_step(engine, step: int, dtype: torch.dtype = torch.float32, report_loss: Any = "real") -> float:
    """Forward, backward and ``engine.step`` on this rank's batch for ``step``; the loss
    handed to the HDET scheduler is the real one unless ``report_loss`` overrides it."""
    x, y = batch(rank(), step)
    loss = F.mse_loss(engine(x.to(dtype)).float(), y)
    engine.backward(loss)
    engine.step(lr_kwargs={"loss": loss if isinstance(report_loss, str) else report_loss})
    return float(loss.detach())


def capture_converge(engine, sched, store: list) -> None:
    """Wrap the sync object's converge: record the fp32 masters and buffers that converge
    is about to average (after the sync step's own optimizer update), then converge."""
    rank_tools.capture_converge(sched, store, lambda: {"master": full_master(engine), "buffers": buffers(engine)})


def _init_dist() -> None:
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")


# ---- 1. converge identity and mean ------------------------------------------------------

def converge_worker() -> dict:
    """Two engines: bf16 (bf16 working copy + fp32 masters, default persistence threshold,
    gradient_sharing global) and fp32 (threshold 0, gradient_sharing replica). Spread 0.5,
    sync at step 3 inside engine.step; the masters are captured right before converge."""
    from hdet_scale.backends.deepspeed import initialize
    out = {}
    cases = {"bf16": dict(bf16=True, threshold=None, sharing="global"),
             "fp32": dict(bf16=False, threshold=0, sharing="replica")}
    for name, c in cases.items():
        dtype = torch.bfloat16 if c["bf16"] else torch.float32
        cfg = ds_config(hdet_block(gradient_sharing=c["sharing"]), bf16=c["bf16"], threshold=c["threshold"])
        engine, opt, _, sched = initialize(build_model(), cfg)
        captured: list = []
        capture_converge(engine, sched, captured)
        res: dict[str, Any] = {"dp_world_size": engine.dp_world_size, "lrs": []}
        for step in (1, 2):
            res["lrs"].append(lrs(opt))
            train_step(engine, step, dtype)
        res["pre_probe"] = probe(engine, dtype)
        res["pre_working"], res["working_dtype"] = full_working(engine)  # just before the sync step
        res["lrs"].append(lrs(opt))
        train_step(engine, 3, dtype)  # sync step: optimizer update, then converge
        res["captured"] = captured
        # The forward first: a GatheredParameters exit re-partitions persistent parameters,
        # which would hide a stale working copy from the next forward.
        res["post_probe"] = probe(engine, dtype)
        res["post_master"] = full_master(engine)
        res["post_working"], _ = full_working(engine)
        res["post_buffers"] = buffers(engine)
        res["nonfinite"] = sched.last_sync.get("hdet/nonfinite_replicas")
        res["sync_step"] = sched.last_sync.get("hdet/step")
        out[name] = res
    return out


# ---- 1b. the persistent parameters' gather after converge ---------------------------------

def gather_worker() -> dict:
    """Every persistent parameter (default threshold: all of TinyNet) given rank-specific
    partitions, then gathered twice from them: by ``ds_gather.gather_persistent`` (one
    all-gather) and by DeepSpeed's own ``param.all_gather`` (one per parameter); fp32 and
    bf16 working copies. Returns both full values per parameter and the collectives
    counted."""
    import torch.distributed as dist

    from hdet_scale.backends.deepspeed import initialize
    from hdet_scale.backends.ds_gather import gather_persistent
    out = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        engine, opt, _, _ = initialize(build_model(), ds_config(hdet_block(), bf16=bf16))
        params = list(opt.persistent_parameters)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        with torch.no_grad():
            for p in params:
                p.ds_tensor.copy_(torch.randn(p.ds_tensor.shape, generator=g).to(p.ds_tensor.dtype))
        res: dict[str, Any] = {"n": len(params), "sizes": [p.ds_numel for p in params]}
        for how in ("ours", "deepspeed"):
            opt._partition_all_parameters()
            if how == "ours":
                res["collectives"] = gather_persistent(params)
            else:
                params[0].all_gather(params)
            res[how] = [to_numpy(p.data.float()) for p in params]
            res[f"{how}_dtype"] = str(params[0].data.dtype)
        out[name] = res
        engine.destroy()
    return out


# ---- 2. spread 0 + global gradient sharing == plain ZeRO-3 data parallelism ------------

def equivalence_worker(steps: int = 7) -> dict:
    """Plain ZeRO-3 over all 4 ranks (no mpu: dp = 4) first (DeepSpeed keeps the last mpu
    in a module global, so the plain engine must come before the HDET ones), then HDET
    2 x 2 with spread 0 in "global" and in "replica" gradient sharing. Same initial
    weights, same per-rank batches, same constant LR. Returns full fp32 params per step."""
    import deepspeed
    from hdet_scale.backends.deepspeed import initialize
    _init_dist()
    out: dict[str, Any] = {}
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    out["plain_dp_world_size"] = engine.dp_world_size
    out["plain"] = []
    for step in range(1, steps + 1):
        train_step(engine, step)
        out["plain"].append(full_master(engine))
    for sharing in ("global", "replica"):
        hdet = hdet_block(gradient_sharing=sharing, axes={"lr": {"spread_ratio": 0.0}})
        engine, opt, _, sched = initialize(build_model(), ds_config(hdet))
        out[f"{sharing}_dp_world_size"] = engine.dp_world_size
        params, rates, syncs = [], [], []
        for step in range(1, steps + 1):
            rates.append(lrs(opt))
            train_step(engine, step)
            params.append(full_master(engine))
            syncs.append(sched.sync_count)
        out[sharing], out[f"{sharing}_lrs"], out[f"{sharing}_syncs"] = params, rates, syncs
    return out


# ---- 3. every rank agrees on permutations and base values -------------------------------

def agreement_worker(steps: int = 9) -> dict:
    """Auto-LR on (the paper's controller and per-group exploration, warm-up 2, sync
    every 2 steps, spread 0.2) over two parameter groups, plus a weight-decay axis (not
    auto): one permutation per (axis, group)."""
    from hdet_scale.backends.deepspeed import initialize
    model = build_model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    hdet = hdet_block(sync_interval=2, seed=3,
                      axes={"lr": {"spread_ratio": 0.2}, "weight_decay": {"spread_ratio": 0.5}},
                      schedule={"name": "onecycle", "total_steps": 20},
                      auto={"enabled": True, "warmup_steps": 2, "temperature": 0.1, "controller": "paper", "fitness": "train_loss", "groups": "independent"})
    engine, opt, _, sched = initialize(model, ds_config(hdet), model_parameters=groups)
    hist = []
    for step in range(1, steps + 1):
        used = {"lr": lrs(opt), "weight_decay": [float(g["weight_decay"]) for g in opt.param_groups]}
        train_step(engine, step)
        hist.append({"used": used, "next_lrs": lrs(opt),
                     "base_lr": [sched.base_value("lr", g) for g in range(len(opt.param_groups))],
                     "base_wd": [sched.base_value("weight_decay", g) for g in range(len(opt.param_groups))],
                     **sched_state(sched)})
    return {"hist": hist, "replica": sched.topology.replica_index, "num_groups": len(opt.param_groups)}


# ---- 4. a NaN loss on one replica --------------------------------------------------------

def nan_worker() -> dict:
    """Auto-LR from the first sync; sync every 3 steps; gradient_sharing replica so the two
    replicas' weights differ at every sync. Replica 1 reports a NaN loss for the second
    interval (steps 4-6; the real loss still drives backward); steps 7-9 are clean. The
    paper's controller, scored by the training loss (the reported NaN)."""
    from hdet_scale.backends.deepspeed import initialize
    hdet = hdet_block(gradient_sharing="replica", axes={"lr": {"spread_ratio": 0.2}},
                      auto={"enabled": True, "warmup_steps": 0, "controller": "paper", "fitness": "train_loss", "groups": "independent"})
    engine, opt, _, sched = initialize(build_model(), ds_config(hdet, threshold=0))
    captured: list = []
    capture_converge(engine, sched, captured)
    replica = sched.topology.replica_index
    records, post = {}, {}
    for step in range(1, 10):
        bad = replica == 1 and 4 <= step <= 6
        train_step(engine, step, report_loss=float("nan") if bad else "real")
        if step % 3 == 0:
            records[step] = {**clean_record(sched.last_sync), "base": {str(k): v for k, v in sched.base.items()},
                             "lrs": lrs(opt)}
            post[step] = full_master(engine)
    return {"replica": replica, "records": records, "post_master": post, "captured": captured}


# ---- 5. exact resume ---------------------------------------------------------------------

RESUME_STEPS, RESUME_AT = 8, 4


def _resume_hdet() -> dict:
    return hdet_block(gradient_sharing="replica", axes={"lr": {"spread_ratio": 0.3}},
                      schedule={"name": "onecycle", "total_steps": 10},
                      auto={"enabled": True, "warmup_steps": 3})  # default: "log", scored by the probe


def resume_worker(ckpt_dir: str, bf16: bool = False) -> dict:
    """A: 8 steps uninterrupted. B: fresh engine, 4 steps (between the syncs at 3 and 6),
    save_checkpoint. C: fresh engine from *other* initial weights, load_checkpoint, steps
    5-8. D: a 4 x 1 layout must refuse the checkpoint before any collective."""
    import deepspeed.runtime.engine as ds_engine  # its copyfile writes DeepSpeed's recovery scripts
    from hdet_scale.backends.deepspeed import initialize, load_checkpoint, save_checkpoint
    from hdet_scale.errors import HDETStateError
    cfg = ds_config(_resume_hdet(), bf16=bf16, threshold=100)  # fc1/fc2 weights partitioned, rest persistent
    dtype = torch.bfloat16 if bf16 else torch.float32
    probe = rank_tools.rank_probe()
    out: dict[str, Any] = {}

    def run(engine, opt, sched, first: int, last: int, key: str) -> None:
        out.setdefault(f"{key}_lrs", {})
        out.setdefault(f"{key}_perms", {})
        for step in range(first, last + 1):
            out[f"{key}_lrs"][step] = lrs(opt)
            train_step(engine, step, dtype)
            out[f"{key}_perms"][step] = sched_state(sched)["permutations"]

    engine, opt, _, sched = initialize(build_model(), cfg, probe=probe)
    run(engine, opt, sched, 1, RESUME_STEPS, "A")
    out["A_master"], out["A_buffers"], out["A_state"] = full_master(engine), buffers(engine), sched_state(sched)
    out["A_working"], _ = full_working(engine)

    engine, opt, _, sched = initialize(build_model(), cfg, probe=probe)
    run(engine, opt, sched, 1, RESUME_AT, "B")
    out["B_master_at_save"] = full_master(engine)
    written: list = []
    with rank_tools.record_writes(ckpt_dir, written, copy_module=ds_engine):
        out["tag"] = save_checkpoint(engine, sched, ckpt_dir)
    out["written"] = written

    engine, opt, _, sched = initialize(build_model(seed=1), cfg, probe=probe)
    out["C_master_before_load"] = full_master(engine)
    load_checkpoint(engine, sched, ckpt_dir)
    out["C_step_after_load"] = sched.step_count
    out["C_master_after_load"] = full_master(engine)
    run(engine, opt, sched, RESUME_AT + 1, RESUME_STEPS, "C")
    out["C_master"], out["C_buffers"], out["C_state"] = full_master(engine), buffers(engine), sched_state(sched)
    out["C_working"], _ = full_working(engine)

    cfg4 = ds_config({**_resume_hdet(), "replicas": 4}, bf16=bf16, threshold=100)
    engine, opt, _, sched = initialize(build_model(), cfg4, probe=probe)
    t0 = time.monotonic()
    out["D_error"] = rank_tools.error_text(lambda: load_checkpoint(engine, sched, ckpt_dir),
                                          (HDETStateError, AssertionError))
    out["D_seconds"] = time.monotonic() - t0
    return out


# ---- 6. a bad config fails on every rank, before any collective ----------------------------

BAD_CONFIGS = {
    "spread_ratio": lambda: ds_config(hdet_block(axes={"lr": {"spread_ratio": 1.5}})),
    "replicas": lambda: ds_config(hdet_block(replicas=3)),
    "scheduler": lambda: {**ds_config(hdet_block()),
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
    "unknown_key": lambda: ds_config(hdet_block(sync_intervall=3)),
}


def no_local_rank_worker() -> dict:
    """The ranks of a world given by ``RANK``/``WORLD_SIZE``/``MASTER_*`` alone (no
    ``LOCAL_RANK``, as a shell leaves them): ``build_topology`` must join that world over
    ``env://`` (not DeepSpeed's MPI discovery, which raises ModuleNotFoundError without mpi4py)."""
    import os

    import torch.distributed as dist

    import hdet_scale

    own = os.environ.pop("LOCAL_RANK")
    cfg = ds_config(hdet_block())
    topology = hdet_scale.build_topology(cfg)
    ranks = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(ranks)
    out = {"world": dist.get_world_size(), "rank_sum": ranks.item(), "replicas": topology.replicas,
           "local_rank": os.environ.get("LOCAL_RANK")}
    # then train under zero.Init, which reads LOCAL_RANK (a KeyError if nothing sets it),
    # and again with the launcher's LOCAL_RANK: the same weights after the same steps
    for name in ("without", "with"):
        os.environ["LOCAL_RANK"] = out["local_rank"] if name == "without" else own
        with hdet_scale.zero_init(topology, cfg):
            model = build_model()
        engine, _, _, _ = hdet_scale.initialize(model, cfg, model_parameters=model.parameters(), topology=topology)
        for step in range(1, 3):  # before the first converge (sync_interval 3): replicas apart
            train_step(engine, step)
        out[name] = full_master(engine)
    return out


def bad_config_worker(case: str) -> None:
    """Initialise torch.distributed first (as a launcher script would), then
    ``hdet_scale`` initialize with a bad config: must raise on this rank by itself."""
    from hdet_scale.backends.deepspeed import initialize
    _init_dist()
    initialize(build_model(), BAD_CONFIGS[case]())
    raise AssertionError(f"initialize accepted the bad config {case!r}")


# ---- gradient sharing overlapped with the backward pass (ds_overlap.py) -------------------

def overlap_worker(steps: int = 4) -> dict:
    """The same HDET run (2 x 2, global gradients, spread 0.3, every tensor partitioned,
    50-element reduce buckets so the backward pass reduces in several buckets) with the
    gradient sharing overlapped and with the hook, at 2 micro-batches per step, and
    once in bf16. Per run: the full fp32 masters after every optimizer step, the
    collectives the overlapped sharing issued, and how many of them it had started before
    the optimizer step (during the backward pass)."""
    from hdet_scale.backends.deepspeed import initialize
    _init_dist()
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        for gas in (2,):  # the boundary of 2 micro-batches: the first only accumulates
            for overlap in (False, True):
                dtype = torch.bfloat16 if bf16 else torch.float32
                hdet = hdet_block(gradient_sharing="global", axes={"lr": {"spread_ratio": 0.3}},
                                  overlap_gradient_sharing=overlap)
                cfg = ds_config(hdet, bf16=bf16, threshold=0)
                cfg["gradient_accumulation_steps"] = gas
                cfg["zero_optimization"]["reduce_bucket_size"] = 50
                if bf16:  # DeepSpeed accumulates bf16 gradients in bf16 unless told: fp32 can be overlapped
                    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
                engine, _, _, sched = initialize(build_model(), cfg)
                sharing = sched.sync_obj.overlapped
                started: list[int] = []
                before_epilogue: list[int] = []  # all-reduces in flight when the backward pass ended
                if sharing is not None:
                    finish = sharing.finish
                    sharing.finish = lambda: (started.append(len(sharing.pending)), finish())[1]
                    opt = engine.optimizer
                    epilogue = opt.independent_gradient_partition_epilogue
                    opt.independent_gradient_partition_epilogue = lambda: (
                        before_epilogue.append(len(sharing.pending)), epilogue())[1]
                masters = []
                for step in range(1, steps + 1):
                    for micro in range(gas):
                        x, y = batch(rank(), 10 * step + micro)
                        loss = F.mse_loss(engine(x.to(dtype)).float(), y)
                        engine.backward(loss)
                        engine.step(lr_kwargs={"loss": loss})
                    masters.append(full_master(engine))
                out[f"{'bf16' if bf16 else 'fp32'}_gas{gas}_{'overlap' if overlap else 'hook'}"] = {
                    "masters": masters, "overlapped": sharing is not None, "started": started,
                    "before_epilogue": before_epilogue,
                    "collectives": None if sharing is None else sharing.collectives,
                    "flat_dtype": str(engine.optimizer.grad_partitions_flat_buffer.dtype)}
    return out


# ---- two jobs in one process -----------------------------------------------------------

def two_jobs_worker() -> dict:
    """A job of two engines, 4 steps each: plain ZeRO-3, then HDET 2 x 2 (which leaves its
    replica-group mpu in DeepSpeed's module globals). Run, then ``hdet_scale.teardown``, then
    the same job in a new world (another rendezvous port, as a notebook's next job or a
    reused test rank gets); then torch's ``destroy_process_group`` alone and the job in a
    third world. Returns the fp32 masters after each engine's last step of the first two
    jobs and the third's error (``None`` if it ran)."""
    import deepspeed
    import hdet_scale
    import torch.distributed as dist
    from hdet_scale.backends.deepspeed import initialize

    def job() -> list[np.ndarray]:
        _init_dist()
        model = build_model()
        plain, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
        engine, _, _, _ = initialize(build_model(), ds_config(hdet_block()))
        out = []
        for e in (plain, engine):
            for step in range(1, 5):
                train_step(e, step)
            out.append(full_master(e))
        return out

    ports = os.environ["HDET_TEST_PORTS"].split(",")
    first = job()
    hdet_scale.teardown()
    os.environ["MASTER_PORT"] = ports[0]
    second = job()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = ports[1]
    try:
        job()
        error = None
    except Exception as e:  # noqa: BLE001 (the error is the result)
        error = f"{type(e).__name__}: {e}"
    return {"first": first, "second": second, "error": error}
