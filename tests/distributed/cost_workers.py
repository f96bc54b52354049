"""Rank worker for tests/distributed/test_cost_counts.py: the bytes every collective of a
real training step and of a converge carries, counted on 4 gloo ranks.

A counting shim wraps ``torch.distributed``'s collectives (the real call still runs):
HDET's averaging, DeepSpeed's comm layer and FSDP2 all look these functions up on the
``torch.distributed`` module at call time. Payload convention (hdet_scale/cost.py): the
bytes of the tensor a rank hands to the collective; all-gather: the gathered output.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

# collective -> the argument whose bytes are its payload
_PAYLOAD = {"all_reduce": 0, "reduce_scatter_tensor": 1, "all_gather_into_tensor": 0, "broadcast": 0}


@contextlib.contextmanager
def counting(log: list):
    """Append ``(collective, group ranks, world group?, payload bytes)`` to ``log`` for
    every call of the collectives in ``_PAYLOAD`` inside the block."""
    saved = {name: getattr(dist, name) for name in _PAYLOAD}

    def wrap(name, real):
        def counted(*args, **kwargs):
            tensor = args[_PAYLOAD[name]] if len(args) > _PAYLOAD[name] else kwargs.get(
                "tensor", kwargs.get("input", kwargs.get("output_tensor")))
            group = kwargs.get("group")
            world = group is None or group is dist.group.WORLD
            ranks = tuple(range(dist.get_world_size())) if world else tuple(dist.get_process_group_ranks(group))
            log.append((name, ranks, world, tensor.numel() * tensor.element_size()))
            return real(*args, **kwargs)
        return counted

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield log
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


def _replica_all_reduce(log: list, ranks: list[int]) -> list[int]:
    """Payloads of the all-reduces on the replica group's ranks (at R = W DeviceMesh
    hands out the world group itself)."""
    return [b for name, g, world, b in log if name == "all_reduce" and g == tuple(ranks)]


def _shapes(module: torch.nn.Module) -> dict:
    from hdet_scale.cost import size_of_module

    size = size_of_module(module)
    return {"shapes": [list(s) for s in size.shapes], "buffer_numel": size.buffer_numel}


def count_worker() -> dict:
    """For replicas 2 and 4 (2 x 2, 4 x 1): DeepSpeed fp32 and bf16, FSDP2 fp32 and bf16
    (``MixedPrecisionPolicy(bf16, reduce fp32)``), gradient_sharing "global". One training
    step counted (gradient sharing), then one ``converge`` called directly. Returns
    ``{case: {"grad": [...], "converge": [...], "shapes", "buffer_numel"}}``."""
    import ds_workers
    import fsdp2_workers
    import rank_tools

    from hdet_scale.backends.deepspeed import initialize as ds_initialize
    from hdet_scale.topology import Layout

    rank_tools.init_dist()
    out: dict[str, Any] = {}
    for replicas in (2, 4):
        block = rank_tools.hdet_block(replicas=replicas, sync_interval=1000)
        ranks = Layout(4, replicas, dist.get_rank()).replica_group_ranks()
        for backend in ("deepspeed", "fsdp2"):
            for precision in ("fp32", "bf16"):
                bf16 = precision == "bf16"
                if backend == "deepspeed":
                    model = ds_workers.build_model()
                    shapes = _shapes(model)
                    engine, _, _, sched = ds_initialize(model, ds_workers.ds_config(block, bf16=bf16))
                    with counting([]) as log:
                        ds_workers.train_step(engine, 1, torch.bfloat16 if bf16 else torch.float32)
                else:
                    model, opt, sched = fsdp2_workers.init(block, bf16=bf16)
                    shapes = _shapes(fsdp2_workers.build_model())
                    with counting([]) as log:
                        fsdp2_workers.train_step(model, opt, sched, 1)
                grad = _replica_all_reduce(log, ranks)
                with counting([]) as log:
                    sched.sync_obj.converge([True] * replicas)
                out[f"{backend} {precision} {replicas}x{4 // replicas}"] = {
                    "grad": grad, "converge": _replica_all_reduce(log, ranks), **shapes}
                if backend == "deepspeed" and hasattr(engine, "destroy"):
                    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return out
