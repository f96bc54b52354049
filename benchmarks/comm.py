"""Converge and gradient-sharing cost against the flat all-reduce limit, with the
collectives each path issues and the memory it allocates (docs/benchmarks.md, "Converge
and gradient sharing").

    OMP_NUM_THREADS=1 python -m benchmarks.comm            # 300 tensors, 19.5M parameters, 13 repeats
    OMP_NUM_THREADS=1 python -m benchmarks.comm --tiny     # smoke test: 12 tensors, 2 repeats, 1 KiB buckets
    python -m benchmarks.comm --report-only                # table from benchmarks/results/comm.jsonl

One launch of 4 local gloo ranks; for each layout (2 x 2 and 4 x 1, replicas x shard
size) every backend (DeepSpeed ZeRO-3, FSDP2, DDP, fairscale OSS) is built in turn, fp32 then
bf16 (DeepSpeed: ``bf16.enabled``, fp32 masters with bf16 working copy and gradients; the
torch backends: the model's parameters in bf16), with ``gradient_sharing: global``.

Timed, interleaved (each repeat runs every variant once, in an order rotated per repeat,
each after a barrier on the world; a variant's time is the slowest rank's):

- ``flat``: one all-reduce on the replica group of a preallocated flat tensor of as many
  elements as converge averages, in the accumulation dtype (float32 for bf16): the same
  bytes on the same group, the limit converge is held to;
- ``average``: ``mean_all_reduce_`` of the masters and buffers with the sync's bucket
  (converge's averaging step); ``refresh``: the backend's refresh alone; ``converge``:
  ``DistributedSync.converge`` (both, as training runs them);
- ``per_tensor``: all-reduce then divide of every tensor on its own, in its own dtype
  (the paper's reference code; DeepSpeed: per-parameter views of its flat masters);
- ``copy``: one memory pass over the flat reference (a preallocated copy), the unit the
  averaging's own passes cost;
- DeepSpeed only (the other engines share gradients with their own all-reduce):
  ``hook``, the gradient-sharing hook on the flat gradient partition, and ``flat_grad``,
  one all-reduce of as many float32 elements.

Ratios per repeat (``converge/flat``, ``average/flat``, ``per_tensor/flat``,
``hook/flat_grad``), then min / median / max over the repeats.

Untimed, one call each under ``torch.profiler``: the collectives issued (c10d ops by
name) and the extra memory, the peak of bytes allocated minus bytes freed during the
call as torch's allocator reports them to the profiler (temporaries inside kernels
included; gloo's own transport buffers are not tensors and are not). ``average`` is
measured on its first call (the sync's bucket still to allocate) and again (reused).
``predicted`` is the count ``hdet_scale.averaging`` documents, computed here from the
tensors' sizes and dtypes.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

RESULTS = "benchmarks/results/comm.jsonl"
BACKENDS = ("deepspeed", "fsdp2", "ddp", "fairscale")
LAYOUTS = {"2x2": 2, "4x1": 4}  # name -> replicas, world of 4
WORLD = 4
FULL = {"d": 512, "blocks": 74, "repeats": 13, "bucket_mb": 25.0}  # 298 parameters + 2 buffers, 19.5M
TINY = {"d": 16, "blocks": 2, "repeats": 2, "bucket_mb": 0.001}  # 10 + 2 tensors; buckets of 1048 B


def _model(d: int, blocks: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(d, d)  # weight (d, d), bias (d)
            self.norm = nn.LayerNorm(d)  # weight, bias (d)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.bn = nn.BatchNorm1d(d)  # weight, bias + running_mean, running_var (persistent buffers)

    torch.manual_seed(0)
    return Net()


def _build(backend: str, dtype: str, block: dict, topology: Any, size: dict) -> tuple[Any, Any, Any]:
    """``(sync, flat gradient partition or None, engine)`` of one backend."""
    import torch

    model = _model(size["d"], size["blocks"])
    def opt_fn(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=1e-3)

    if backend == "deepspeed":
        from hdet_scale import initialize

        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": dtype == "bf16"}, "hdet": block}
        engine, _, _, sched = initialize(model, ds, optimizer=opt_fn(model.parameters()), topology=topology)
        return sched.sync_obj, engine.optimizer.grad_partitions_flat_buffer, engine
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if backend == "fsdp2":
        from hdet_scale.backends import fsdp2
        engine, _, sched = fsdp2.initialize(model, block, opt_fn, shard_modules=lambda m: list(m.blocks),
                                            topology=topology)
    elif backend == "ddp":
        from hdet_scale.backends import ddp
        engine, _, sched = ddp.initialize(model, block, opt_fn, topology=topology)
    else:
        from hdet_scale.backends import fairscale
        engine, _, sched = fairscale.initialize(model, block, torch.optim.AdamW, {"lr": 1e-3}, topology=topology)
    return sched.sync_obj, None, engine


def predicted_calls(tensors: list, bucket_bytes: int) -> int | None:
    """The all-reduces ``mean_all_reduce_`` documents: per accumulation dtype, one per
    contiguous tensor already in it of at least a bucket, plus ceil(the rest's bytes in
    that dtype / bucket). ``None`` when a tensor is not contiguous (the docstring then
    gives an upper bound only)."""
    import torch

    if any(not t.is_contiguous() for t in tensors):
        return None
    groups: dict = {}
    for t in tensors:
        if t.numel():
            acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
            groups.setdefault((acc, t.device), []).append(t)
    calls = 0
    for (acc, _), ts in groups.items():
        cap = bucket_bytes // acc.itemsize
        big = [t.dtype == acc and t.numel() >= cap for t in ts]
        calls += sum(big) + math.ceil(sum(t.numel() for t, b in zip(ts, big) if not b) / cap)
    return calls


def _per_param(backend: str, engine: Any, tensors: list, sync: Any) -> list:
    """The tensors the paper's reference code loops over: one per parameter (and buffer).
    DeepSpeed's masters are flat partitions; its per-parameter views of them instead."""
    if backend != "deepspeed":
        return tensors
    from deepspeed.utils import safe_get_local_fp32_param

    views = [safe_get_local_fp32_param(p) for p in engine.module.parameters()]
    return [v for v in views if v is not None and v.numel()] + list(sync.backend.buffers())


def _per_tensor(tensors: list, group: Any, n: int) -> None:
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for t in tensors:
            dist.all_reduce(t, group=group)
            t.div_(n)


def _profiled(fn: Callable[[], Any]) -> dict:
    """``{"collectives": {c10d op: count}, "extra_bytes": peak net allocation}`` of one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    counts: dict[str, int] = {}
    for e in events:
        if e.name().startswith("c10d::"):
            counts[e.name()[6:]] = counts.get(e.name()[6:], 0) + 1
    running = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return {"collectives": counts, "extra_bytes": peak}


def _measure(backend: str, dtype: str, layout: str, block: dict, topology: Any, size: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from hdet_scale.averaging import BucketBuffer, mean_all_reduce_

    sync, grad, engine = _build(backend, dtype, block, topology, size)
    group, R, bucket = topology.replica_group, topology.replicas, sync.bucket_bytes
    tensors = [t for t in list(sync.backend.master_tensors()) + list(sync.backend.buffers()) if t.numel()]
    acc_numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(acc_numel, dtype=torch.float32)
    src = torch.ones(acc_numel, dtype=torch.float32)
    variants: dict[str, Callable[[], Any]] = {
        "flat": lambda: dist.all_reduce(flat, group=group),
        "copy": lambda: flat.copy_(src),
        "average": lambda: mean_all_reduce_(tensors, group, bucket, buffer=sync.bucket),
        "refresh": sync.backend.refresh,
        "converge": lambda: sync.converge([True] * R),
        "per_tensor": lambda: _per_tensor(_per_param(backend, engine, tensors, sync), group, R),
    }
    if grad is not None:
        flat_grad = torch.zeros(grad.numel(), dtype=torch.float32)
        variants["hook"] = lambda: sync.share_gradients([grad])
        variants["flat_grad"] = lambda: dist.all_reduce(flat_grad, group=group)

    sync.bucket = BucketBuffer()  # measure the first call's allocation
    profiled = {"average_first": _profiled(variants["average"]), "average": _profiled(variants["average"]),
                "refresh": _profiled(variants["refresh"])}
    if grad is not None:
        profiled["hook_first"] = _profiled(variants["hook"])
        profiled["hook"] = _profiled(variants["hook"])

    names = list(variants)
    times = torch.zeros(size["repeats"], len(names), dtype=torch.float64)
    for rep in range(size["repeats"]):
        for k in range(len(names)):
            i = (k + rep) % len(names)  # rotate the order: no variant always runs first
            dist.barrier()
            t0 = time.perf_counter()
            variants[names[i]]()
            times[rep, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each variant's time: the slowest rank's

    local_bytes = sum(t.numel() * t.element_size() for t in tensors)
    record = {"layout": layout, "replicas": R, "shard_size": topology.shard_size, "backend": backend, "dtype": dtype,
              "tensors": len(tensors), "local_bytes": local_bytes, "message_bytes": 4 * acc_numel,
              "bucket_bytes": bucket, "grad_bytes": None if grad is None else grad.numel() * grad.element_size(),
              "grad_dtype": None if grad is None else str(grad.dtype).replace("torch.", ""),
              "predicted": {"average": predicted_calls(tensors, bucket),
                            "hook": None if grad is None else predicted_calls([grad], bucket)},
              "profiled": profiled, "held_bucket_bytes": sync.bucket.nbytes,
              "times_ms": {n: [1e3 * float(x) for x in times[:, i]] for i, n in enumerate(names)}}
    ratios = {"converge/flat": ("converge", "flat"), "average/flat": ("average", "flat"), "copy/flat": ("copy", "flat"),
              "refresh/flat": ("refresh", "flat"), "per_tensor/flat": ("per_tensor", "flat"),
              "hook/flat_grad": ("hook", "flat_grad")}
    record["ratios"] = {}
    for label, (a, b) in ratios.items():
        if a in names:
            r = [x / y for x, y in zip(record["times_ms"][a], record["times_ms"][b])]
            record["ratios"][label] = [min(r), statistics.median(r), max(r)]
    if hasattr(engine, "destroy"):
        engine.destroy()
    return record if dist.get_rank() == 0 else None


def _rank_main(layouts: list, size: dict, backends: list, dtypes: list) -> list[dict] | None:
    """One rank (``benchmarks.ranks.run_ranks`` set its environment): every layout, dtype
    and backend; rank 0's records."""
    import logging

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    if "deepspeed" in backends:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.ERROR)
    from hdet_scale.backends.common import build_topology

    records = []
    for layout in layouts:  # one engine at a time; DeepSpeed takes its mpu at each initialize
        block = {"replicas": LAYOUTS[layout], "sync_interval": 1000, "gradient_sharing": "global",
                 "bucket_mb": size["bucket_mb"], "auto": {"enabled": False},
                 "schedule": {"name": "constant", "total_steps": 10 ** 6}}
        topology = build_topology(block, "cpu")
        for d in dtypes:
            for b in backends:
                records.append(_measure(b, d, layout, block, topology, size))
                gc.collect()  # the engine just measured, before the next is built
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return records if rank == 0 else None


def launch(layouts: list, size: dict, backends: list, dtypes: list, timeout: float) -> list[dict]:
    """Measure every layout, dtype and backend on 4 spawned ranks (one launch); rank 0's records."""
    from benchmarks.ranks import run_ranks

    target = importlib.import_module("benchmarks.comm")._rank_main  # picklable by module name under -m
    return run_ranks(target, WORLD, (layouts, size, backends, dtypes), timeout=timeout)[0]


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}" if x < 2 ** 20 * 10 else f"{x / 2 ** 20:.0f}"


def _size(b: float) -> str:
    return f"{b:.0f} B" if b < 1024 else f"{b / 1024:.1f} KiB" if b < 2 ** 20 else f"{b / 2 ** 20:.1f} MiB"


def _ratio(rec: dict, key: str) -> str:
    r = rec["ratios"].get(key)
    return "" if r is None else f"{r[1]:.2f} ({r[0]:.2f}-{r[2]:.2f})"


def _calls(p: dict) -> str:
    return ", ".join(f"{n} {c}" for n, c in sorted(p["collectives"].items())) or "none"


def _extra(rec: dict, key: str, of: int) -> str:
    b = rec["profiled"][key]["extra_bytes"]
    return f"{_size(b)} = {b / rec['bucket_bytes']:.2f} bkt = {100 * b / of:.1f} %"


def report(records: list[dict]) -> str:
    lines = [("### Time, ratio to one flat all-reduce of the same bytes on the replica group "
              "(median, min-max over repeats)"), "",
             ("| R x S | dtype | backend | tensors | local MiB | converge | average | refresh | per tensor "
              "| one copy pass | hook (vs flat grad) |"), "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['layout']} | {r['dtype']} | {r['backend']} | {r['tensors']} | {_mib(r['local_bytes'])} | "
                     f"{_ratio(r, 'converge/flat')} | {_ratio(r, 'average/flat')} | {_ratio(r, 'refresh/flat')} | "
                     f"{_ratio(r, 'per_tensor/flat')} | {_ratio(r, 'copy/flat')} | {_ratio(r, 'hook/flat_grad')} |")
    lines += ["", ("### Collectives and extra memory per call (bkt: buckets; %: of the local tensors averaged, "
                   "or of the gradient partition for the hook)"), "",
              ("| R x S | dtype | backend | average: collectives (predicted) | average, first call | "
               "average, reused bucket | refresh: collectives | refresh, memory | hook: collectives (predicted) "
               "| hook, first call | hook, reused |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        p = r["profiled"]
        hook = ["", "", ""]
        if "hook" in p:
            hook = [f"{_calls(p['hook'])} ({r['predicted']['hook']})", _extra(r, "hook_first", r["grad_bytes"]),
                    _extra(r, "hook", r["grad_bytes"])]
        lines.append(f"| {r['layout']} | {r['dtype']} | {r['backend']} | {_calls(p['average'])} "
                     f"({r['predicted']['average']}) | {_extra(r, 'average_first', r['local_bytes'])} | "
                     f"{_extra(r, 'average', r['local_bytes'])} | {_calls(p['refresh'])} | "
                     f"{_extra(r, 'refresh', r['local_bytes'])} | " + " | ".join(hook) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="smoke test: a few tensors, 2 repeats, 1 KiB buckets")
    ap.add_argument("--repeats", type=int, help="override the number of interleaved repeats")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--json", action="store_true", help="also print each record as one JSON line")
    ap.add_argument("--out", help=f"results file (default: {RESULTS}; none for --tiny)")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    out = args.out or (None if args.tiny else RESULTS)
    if args.report_only:
        with open(out or RESULTS) as f:
            print(report([json.loads(line) for line in f if line.strip()]))
        return
    size = dict(TINY if args.tiny else FULL)
    if args.repeats:
        size["repeats"] = args.repeats
    records = launch(args.layouts.split(","), size, args.backends.split(","), args.dtypes.split(","),
                     timeout=300 if args.tiny else 3600)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    if args.json:
        for r in records:
            print("RECORD " + json.dumps(r))
    print(report(records))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
