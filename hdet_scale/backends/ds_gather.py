"""ZeRO-3's persistent parameters re-gathered in one collective after converge.

ZeRO-3 keeps parameters below ``stage3_param_persistence_threshold`` (biases, norms: a
few hundred tensors in a large model) gathered on every rank between steps. After
converge has averaged the partitions, their gathered copies are stale and must be
gathered again. DeepSpeed's ``param.all_gather(list)`` issues one all-gather per
parameter even on its "coalesced" path (deepspeed 0.19: one async all-gather per tensor,
waited together), i.e. hundreds of small collectives per sync, each paying the link's
latency. Here the partitions of all of them are packed into one flat tensor per
(process group, dtype), gathered with one synchronous ``all_gather``, and unpacked into
each parameter's full tensor. ``all_gather_coalesced``, DeepSpeed's one-collective gather,
is not used: on CPU / gloo it once returned uninitialised values (a warm-init test saw an
RMS of 6e17 in one of three CI runs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_persistent(params: list[Any]) -> int:
    """Gather the full value of each ZeRO-3 parameter in ``params`` whose partition is
    current and whose full tensor is released (``ds_status`` NOT_AVAILABLE), from the
    partitions (``ds_tensor``, 1-D, ``ds_numel`` padded to the group) of its partition
    group: sets ``param.data`` (shape ``ds_shape``, the partition's dtype) and marks it
    AVAILABLE, as ``param.all_gather`` does. Parameters with a secondary (hpZ) or
    quantized partition are left to DeepSpeed's own gather. Collective on each
    parameter's partition group (every rank of it calls with the same parameters, as
    for ``param.all_gather``). Returns the number of collectives issued (one per
    process group of more than one rank and dtype). Memory: one flat buffer of the gathered parameters per
    group and dtype, freed on return, plus each parameter's own full tensor."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    own, others = [], []
    for p in todo:
        plain = getattr(p, "ds_secondary_tensor", None) is None and not hasattr(p.ds_tensor, "ds_quant_scale")
        (own if plain else others).append(p)
    if others:
        others[0].all_gather(others)
    by_group: dict[tuple[int, torch.dtype], list[Any]] = {}
    for p in own:
        by_group.setdefault((id(p.ds_process_group), p.ds_tensor.dtype), []).append(p)
    for group_params in by_group.values():
        _gather_group(group_params)
    return sum(dist.get_world_size(ps[0].ds_process_group) > 1 for ps in by_group.values()) + (1 if others else 0)


@torch.no_grad()
def _gather_group(params: list[Any]) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    group = params[0].ds_process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [p.ds_tensor.ds_numel for p in params]
    per_rank = sum(sizes)
    flat = torch.empty(world * per_rank, dtype=params[0].ds_tensor.dtype, device=params[0].ds_tensor.device)
    blocks = list(flat.view(world, per_rank))  # rank r's packed partitions: row r
    offset = 0
    for p, n in zip(params, sizes):
        blocks[rank][offset:offset + n].copy_(p.ds_tensor.view(-1)[:n])
        offset += n
    if world > 1:  # a group of one holds the whole parameter already (DeepSpeed issues nothing either)
        dist.all_gather(blocks, blocks[rank], group=group)
    rows = flat.view(world, per_rank)
    offset = 0
    for p, n in zip(params, sizes):
        # row r holds elements [r n, (r + 1) n) of the padded parameter: column block, row-major
        full = rows[:, offset:offset + n].reshape(-1)[:p.ds_numel]
        p.data = full.clone().view(p.ds_shape)
        p.ds_status = ZeroParamStatus.AVAILABLE
        offset += n

