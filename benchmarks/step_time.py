"""Step time of HDET against the same engine without HDET, on the same ranks and global
batch (docs/benchmarks.md, "Step time: HDET against plain ZeRO-3 and FSDP2").

    OMP_NUM_THREADS=1 python -m benchmarks.step_time          # 4 ranks, T = 100, 5 repeats (~18 min here)
    OMP_NUM_THREADS=1 python -m benchmarks.step_time --tiny   # smoke test: T = 4, 2 repeats
    python -m benchmarks.step_time --report-only              # table from benchmarks/results/step_time.jsonl

One launch of 4 local gloo ranks, the trainer's Llama (``hdet_scale.train.model``; 4
layers, hidden 256, 3.4M parameters), float32, AdamW, micro-batch 2 x 64 tokens per rank,
no accumulation: the global batch is 8 x 64 tokens in every variant. The variants:

- ``ds_plain``: ``deepspeed.initialize``, ZeRO-3 over all 4 ranks, no HDET (what a user
  runs today); ``ds_global`` / ``ds_replica``: ``hdet_scale.initialize`` at 2 x 2
  (replicas x shard size), ``gradient_sharing`` ``global`` (ZeRO-3's reduce-scatter in
  the shard group, and HDET all-reduces each bucket's gradient partitions over the
  replica group as the backward pass writes them, ``backends/ds_overlap.py``: the
  gradient of all 4 ranks, as plain ZeRO-3) or ``replica`` (the shard group's
  reduce-scatter alone); ``ds_global_hook``: ``global`` with
  ``overlap_gradient_sharing: false`` (one all-reduce of the whole partition in a hook
  after the backward pass);
- ``fsdp2_plain``: ``fully_shard`` of each decoder layer and the root over all 4 ranks;
  ``fsdp2_hsdp``: the same on a 2 x 2 mesh (HSDP: Replicate x Shard, no HDET, the same
  layout as HDET's); ``fsdp2_global`` / ``fsdp2_replica``: ``backends.fsdp2.initialize``
  at 2 x 2.

Every HDET variant runs with sync interval T (100), a spread (ratio 0.5) and auto-LR (the
``train_loss`` fitness, which needs no probe forward passes). Each repeat builds every
variant in turn (an order rotated per repeat), runs 5 warm-up steps untimed, then times T
steps after a barrier: the window holds exactly one converge and one auto-LR update, so
its mean is the step time amortised as training sees it. A variant's time is its slowest
rank's. Ratios are taken per repeat (``ds_global / ds_plain`` ...), then min / median /
max over the repeats.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

RESULTS = "benchmarks/results/step_time.jsonl"
WORLD, REPLICAS = 4, 2
WARMUP = 5
FULL = {"T": 100, "repeats": 5, "hidden": 256, "layers": 4, "seq": 64, "micro": 2, "bucket": 400_000}
TINY = {"T": 4, "repeats": 2, "hidden": 32, "layers": 2, "seq": 16, "micro": 2, "bucket": 4_000}
VARIANTS = ("ds_plain", "ds_global", "ds_global_hook", "ds_replica", "fsdp2_plain", "fsdp2_hsdp", "fsdp2_global", "fsdp2_replica")
RATIOS = {"ds_global": "ds_plain", "ds_global_hook": "ds_plain", "ds_replica": "ds_plain", "fsdp2_hsdp": "fsdp2_plain",
          "fsdp2_global": "fsdp2_plain", "fsdp2_replica": "fsdp2_plain"}


def _model(size: dict) -> Any:
    import torch

    from hdet_scale.train.model import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=size["hidden"], num_layers=size["layers"], num_heads=4, num_kv_heads=4,
                      intermediate_size=size["hidden"] * 11 // 4, max_seq_len=size["seq"])
    return build_model(cfg)


def _block(size: dict, mode: str) -> dict:
    return {"replicas": REPLICAS, "sync_interval": size["T"], "gradient_sharing": mode,
            "axes": {"lr": {"spread_ratio": 0.5}},
            "auto": {"enabled": True, "fitness": "train_loss"},
            "schedule": {"name": "constant", "total_steps": 10 ** 6}}


def _build(variant: str, size: dict, meshes: dict, topology: Any) -> Any:
    """A closure running one optimizer step of ``variant`` on a batch, returning nothing."""
    import deepspeed
    import torch
    from torch.distributed.fsdp import fully_shard

    from hdet_scale.train.model import loss_fn

    model = _model(size)

    def adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=1e-3)

    if variant.startswith("ds_"):
        from deepspeed.utils import groups

        import hdet_scale

        ds = {"train_micro_batch_size_per_gpu": size["micro"], "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True,
              # ~1/8 of the model per gradient bucket, as a large model has many buckets at
              # DeepSpeed's default (5e8 elements would hold this whole model in one, and
              # nothing could overlap the backward pass)
              "zero_optimization": {"stage": 3, "reduce_bucket_size": size["bucket"]}}
        if variant == "ds_plain":
            groups.mpu = None  # an HDET engine built before left its mpu (R x S groups) behind
            engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=ds)
            hdet = False
        else:
            ds["hdet"] = _block(size, variant.split("_")[1])
            # ds_global shares gradients overlapped with the backward pass (ds_overlap.py,
            # the default); ds_global_hook in one all-reduce after it (the hook)
            ds["hdet"]["overlap_gradient_sharing"] = not variant.endswith("_hook")
            engine, _, _, scheduler = hdet_scale.initialize(model, ds, optimizer=adamw(model.parameters()),
                                                            topology=topology)
            hdet = True

        def step(x: Any, y: Any) -> None:
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step(lr_kwargs={"loss": loss.detach()}) if hdet else engine.step()
        step.engine = engine
        # whether the gradient sharing ran overlapped (ds_overlap.py took it) or as the hook
        step.overlapped = hdet and scheduler.sync_obj.overlapped is not None
        return step
    if variant in ("fsdp2_plain", "fsdp2_hsdp"):
        mesh = meshes["flat" if variant == "fsdp2_plain" else "hsdp"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt, sched = adamw(model.parameters()), None
    else:
        from hdet_scale.backends import fsdp2

        model, opt, sched = fsdp2.initialize(model, _block(size, variant.split("_")[1]), adamw,
                                             shard_modules=lambda m: m.model.layers, topology=topology)

    def step(x: Any, y: Any) -> None:
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step(loss.detach())
    step.engine, step.overlapped = None, False
    return step


def _time_window(step: Any, batches: list, steps: int) -> float:
    """Seconds for ``steps`` optimizer steps, the slowest rank's, after a barrier."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _rank_main(size: dict, variants: list) -> dict | None:
    """One rank (``benchmarks.ranks.run_ranks`` set its environment); rank 0's record."""
    import logging

    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger
    from torch.distributed.device_mesh import init_device_mesh

    from hdet_scale.backends.common import build_topology

    warnings.filterwarnings("ignore")
    ds_logger.setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    topology = build_topology(_block(size, "global"), "cpu")
    meshes = {"flat": init_device_mesh("cpu", (WORLD,)),
              "hsdp": init_device_mesh("cpu", (REPLICAS, WORLD // REPLICAS), mesh_dim_names=("replicate", "shard"))}
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = []
    for _ in range(8):
        tokens = torch.randint(0, 256, (size["micro"], size["seq"] + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    times: dict[str, list[float]] = {v: [] for v in variants}
    overlapped: dict[str, bool] = {}
    for rep in range(size["repeats"]):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            step = _build(v, size, meshes, topology)
            overlapped[v] = step.overlapped
            _time_window(step, batches, WARMUP)
            times[v].append(_time_window(step, batches, size["T"]) / size["T"])
            if step.engine is not None:
                step.engine.destroy()
            del step
            gc.collect()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return None
    from hdet_scale.train.model import param_count

    return {"size": size, "world": WORLD, "replicas": REPLICAS, "params": param_count(_model(size)),
            "step_s": times, "overlapped": overlapped, "load": os.getloadavg()[0]}


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def report(rec: dict) -> str:
    t = rec["step_s"]
    n = len(next(iter(t.values())))
    lines = [f"{rec['params'] / 1e6:.1f}M parameters, {rec['world']} ranks, T = {rec['size']['T']}, {n} repeats, "
             f"load average {rec['load']:.1f} at the end",
             "", "| variant | step (ms), median | vs | ratio min / median / max |", "|---|---:|---|---|"]
    for v in t:
        med = statistics.median(t[v]) * 1e3
        ref = RATIOS.get(v)
        if ref and ref in t:
            lo, mid, hi = _stats([a / b for a, b in zip(t[v], t[ref])])
            lines.append(f"| {v} | {med:.1f} | {ref} | {lo:.3f} / {mid:.3f} / {hi:.3f} |")
        else:
            lines.append(f"| {v} | {med:.1f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="smoke test: a tiny model, T = 4, 2 repeats; not recorded")
    p.add_argument("--report-only", action="store_true", help=f"print the table of the last record in {RESULTS}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = p.parse_args(argv)
    if args.report_only:
        with open(RESULTS) as f:
            print(report(json.loads(f.read().strip().splitlines()[-1])))
        return
    from benchmarks.ranks import run_ranks

    size = TINY if args.tiny else FULL
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    target = importlib.import_module("benchmarks.step_time")._rank_main  # picklable by module name under -m
    rec = run_ranks(target, WORLD, (size, variants), timeout=3600)[0]
    if args.tiny:
        print(json.dumps(rec))
    else:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print(report(rec))


if __name__ == "__main__":
    sys.exit(main())
