"""Bucketed mean all-reduce of local tensors over the replica group.

Converge (paper Eq. 3: ``theta_r <- mean_r' theta_r'``) and global gradient sharing both
average a rank's *local* tensors (ZeRO-3 / FSDP shards, fp32 masters, flat gradient
partitions) with the ranks holding the same shard index in the other replicas. One
collective per bucket, not per tensor: tensors of one dtype are packed into flat buckets
of at most ``bucket_bytes``; a tensor at least that large is reduced in place on its own.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for group in by_key.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if nbytes >= bucket_bytes:
                yield [t]
                continue
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def persistent_float_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers converge averages: floating and persistent (in ``state_dict``), such
    as BatchNorm running statistics. Non-persistent ones (rotary tables) are derived
    constants, equal on every replica; averaging them could change their bits."""
    persistent = set(module.state_dict().keys())
    return [b for n, b in module.named_buffers() if n in persistent and b.is_floating_point()]


@torch.no_grad()
def mean_all_reduce_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int,
                     contribute: bool = True, contributors: int | None = None) -> int:
    """Replace every tensor by its mean over ``group``, in place.

    Args:
        tensors: this rank's local tensors (any shapes; floating dtypes). Every rank of
            ``group`` must pass tensors of the same shapes, dtypes and order.
        group: the process group (the replica group for HDET).
        bucket_bytes: flat-bucket size in bytes.
        contribute: ``False`` leaves this rank's values out of the mean (a replica whose
            interval loss was non-finite); the rank still receives the mean.
        contributors: how many ranks of ``group`` contribute (default: its size).

    Low-precision tensors are summed in float32 and cast back, so a bf16 buffer is
    averaged with one rounding. The result is identical on every rank of the group
    (one all-reduce result, divided by the same integer).

    Returns:
        The number of collectives issued.
    """
    n = dist.get_world_size(group) if contributors is None else contributors
    calls = 0
    for bucket in _buckets([t for t in tensors if t.numel() > 0], bucket_bytes):
        low = bucket[0].dtype in (torch.float16, torch.bfloat16)
        if len(bucket) == 1 and not low and bucket[0].is_contiguous():
            flat = bucket[0]
        else:
            flat = torch.cat([t.reshape(-1).float() if low else t.reshape(-1) for t in bucket])
        if not contribute:
            flat.zero_()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(n)
        if flat is not bucket[0]:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        calls += 1
    return calls
