"""The trainer's weight init, the same whether the model is whole or sharded.

``init_weights`` draws every parameter from its own seeded stream, in fixed blocks of
the flattened tensor, so each rank draws only the blocks overlapping its shard and the
values at an index do not depend on who holds it:

- a whole tensor (DDP, fairscale, or the model built unsharded): indices ``0..n-1``;
- an FSDP2 DTensor (``Shard(0)``, after ``fully_shard`` + ``to_empty``): its dim-0 chunk,
  one contiguous range of the flattened tensor;
- a ZeRO-3 partition (built under ``deepspeed.zero.Init``): ``p.ds_tensor``, the
  ``s``-th ``partition_numel()`` slice of the flattened tensor (zero padding past ``n``).

So a sharded build equals the unsharded one bit for bit, for any S, and costs each rank
``1/S`` of the draws. The distribution is Llama's (Hugging Face ``_init_weights``):
``N(0, initializer_range^2)`` for matrices and embeddings, ones for RMSNorm weights,
zeros for biases.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

#: Elements per seeded block: large enough that stream set-up is negligible, small enough
#: that a rank's boundary blocks cost little beyond its shard.
BLOCK = 1 << 20


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their *parameters* on the meta device (no memory, no init)
    and their buffers where they would be: buffers computed at construction (RoPE
    tables) keep their values, which ``torch.device("meta")`` would lose."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(seed: int, name: str, numel: int, start: int, stop: int, std: float) -> torch.Tensor:
    """Elements ``start..stop-1`` of parameter ``name``'s flattened N(0, std^2) init
    (``numel`` elements in all), float32 on CPU."""
    out = torch.empty(stop - start, dtype=torch.float32)
    for b in range(start // BLOCK, (stop - 1) // BLOCK + 1 if stop > start else 0):
        # A block's length depends on the tensor only (never on the rank): CPU normal_
        # draws of different lengths need not share a prefix.
        lo, hi = b * BLOCK, min((b + 1) * BLOCK, numel)
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.empty(hi - lo, dtype=torch.float32).normal_(0.0, std, generator=gen)
        a, z = max(lo, start), min(hi, stop)
        out[a - start:z - start] = block[a - lo:z - lo]
    return out


def _local_range(p: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(local flat tensor, start, stop, numel)``: where this rank's part of ``p`` sits
    in the flattened full tensor of ``numel`` elements."""
    if hasattr(p, "ds_tensor"):  # ZeRO-3 partition
        part = p.ds_tensor.view(-1)
        start = dist.get_rank(group=p.ds_process_group) * part.numel()
        return part, start, min(start + part.numel(), max(p.ds_numel, start)), p.ds_numel
    if hasattr(p, "to_local"):  # FSDP2 DTensor
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
            raise ValueError("init_weights handles FSDP2's dim-0 sharding only")
        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row = math.prod(p.shape[1:])
        start = offset[0] * row if len(offset) else 0
        return local.view(-1), start, start + math.prod(shape), p.numel()
    return p.view(-1), 0, p.numel(), p.numel()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter of ``model`` (whole, FSDP2-sharded or ZeRO-3
    partitioned; see the module docstring) from ``seed``: matrices and embeddings
    ``N(0, std^2)``, ``*norm*`` weights 1, biases 0. Tied parameters are drawn once
    (under their first name). No communication; every rank writes only its own part.

    Raises:
        ValueError: an FSDP2 parameter sharded on another dim than 0.
    """
    for name, p in model.named_parameters():
        local, start, stop, numel = _local_range(p)
        if local.numel() > stop - start:
            local[stop - start:].zero_()  # ZeRO-3 padding past the last element
        local = local[:stop - start]
        if name.endswith("bias"):
            local.zero_()
        elif "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
            local.fill_(1.0)
        else:
            local.copy_(_draw(seed, name, numel, start, stop, std))
