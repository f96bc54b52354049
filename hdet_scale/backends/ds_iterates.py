"""Optimizers with several iterates (schedule-free AdamW: :mod:`hdet_scale.iterates`) as a
ZeRO-3 client optimizer.

ZeRO-3 keeps the client optimizer's parameter groups empty between steps and, inside its
step, fills one group at a time with one sub-group's fp32 master partition, steps the
client, and empties the group again (deepspeed 0.19 ``stage3.py``, ``_optimizer_step``).
Two consequences for an optimizer that keeps per-group state and moves its parameters
between a training and an evaluation point:

- its state (keyed by the partitions) and its ``train()`` / ``eval()`` reach the
  partitions only while the groups are filled: :func:`filled_client`;
- it would count a step in every group at every call, and in a group split into several
  sub-groups once per sub-group: :func:`step_groups_once`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from hdet_scale import iterates


@contextlib.contextmanager
def filled_client(zero_optimizer: Any) -> Iterator[Any]:
    """The client optimizer (``zero_optimizer.optimizer``) with each parameter group
    holding this rank's fp32 master partitions of it (``fp32_partitioned_groups_flat``,
    1-D float32, one per sub-group); emptied again on exit, as ZeRO-3 leaves them."""
    inner = zero_optimizer.optimizer
    saved = [g["params"] for g in inner.param_groups]
    for g in inner.param_groups:
        g["params"] = []
    for sub, flat in enumerate(zero_optimizer.fp32_partitioned_groups_flat):
        inner.param_groups[zero_optimizer.sub_group_to_group_id[sub]]["params"].append(flat)
    try:
        yield inner
    finally:
        for g, params in zip(inner.param_groups, saved):
            g["params"] = params


def step_groups_once(zero_optimizer: Any) -> None:
    """Wrap the client's ``step`` so that each call sees only the filled group, and a
    group's later sub-groups start from the values (:attr:`IterateSpec.group_state`:
    schedule-free's ``k``, ``weight_sum``, ``lr_max``) its first sub-group started from:
    every sub-group takes the same step and the group counts one step per optimizer
    step. ZeRO's own ``step`` is wrapped to mark where an optimizer step begins."""
    inner = zero_optimizer.optimizer
    keys = iterates.spec_for(inner).group_state
    start: dict[int, dict[str, Any]] = {}  # id(group) -> its values before this optimizer step
    inner_step, outer_step = inner.step, zero_optimizer.step

    def step_filled(*args: Any, **kwargs: Any) -> Any:
        groups = inner.param_groups
        filled = [g for g in groups if g["params"]]
        for g in filled:
            if id(g) in start:
                g.update(start[id(g)])
            else:
                start[id(g)] = {k: g[k] for k in keys if k in g}
        inner.param_groups = filled
        try:
            return inner_step(*args, **kwargs)
        finally:
            inner.param_groups = groups

    def step(*args: Any, **kwargs: Any) -> Any:
        start.clear()
        return outer_step(*args, **kwargs)

    inner.step, zero_optimizer.step = step_filled, step
