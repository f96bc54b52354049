"""Optimizers that keep more than one iterate: what converge averages besides the
parameters, and the switch between the point that trains and the point that is evaluated.

Schedule-free optimizers (Defazio et al., "The Road Less Scheduled", arXiv 2405.15682;
``schedulefree`` on PyPI) keep three sequences per parameter: ``z`` (the base Adam / SGD
sequence, optimizer state ``"z"``), ``x`` (a weighted average of the z's: the point to
evaluate and to save) and ``y = (1 - beta1) z + beta1 x`` (where gradients are taken).
The parameters hold y in train mode and x in eval mode (``optimizer.train()`` /
``optimizer.eval()``). x is linear in y and z, so averaging the parameters *and* z over
the replicas gives every replica the same x as well: HDET's converge (paper Eq. 3)
extends to these optimizers by averaging the state tensors named here. The per-group
running scalars (``weight_sum``, ``lr_max``: they weight the next z into x) differ
between replicas that ran different LRs and are averaged too, so that after converge
every replica holds the same optimizer state, as with AdamW under shared gradients.

An optimizer of the user's declares the same by an attribute::

    class MyOptimizer(torch.optim.Optimizer):
        hdet_iterates = IterateSpec(state_keys=("z",), group_keys=(), modes=True)

Covered by name (``KNOWN``): schedulefree's ``AdamWScheduleFree``, ``SGDScheduleFree``,
``RAdamScheduleFree``, their ``...Closure`` forms (no modes) and the ``...Reference`` forms
(which keep x and y as state too). Adam(W), SGD,
Prodigy and DeepSpeed's optimizers keep one iterate (their moments are not iterates:
with shared gradients they are equal across replicas already) and need nothing.

Pure (no ``torch.distributed``): the sync objects do the averaging.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["IterateSpec", "KNOWN", "spec_for", "state_tensors", "group_scalars", "set_group_scalars",
           "has_modes", "in_train_mode", "train_mode_", "switch_", "eval_mode"]


@dataclass(frozen=True)
class IterateSpec:
    """What converge averages in an optimizer besides the parameters.

    Attributes:
        state_keys: per-parameter state tensors that are iterates (same shape and
            sharding as the parameter), averaged with it.
        group_keys: per-parameter-group float scalars averaged at converge.
        modes: the optimizer has ``train()`` / ``eval()`` that move the parameters
            between the training point and the evaluation point (its param groups hold
            ``"train_mode"``); probes, validation and saved models use eval mode.
        group_state: per-group keys that are running state, not settings (a resume
            restores them without a word about a changed setting).
    """

    state_keys: tuple[str, ...] = ()
    group_keys: tuple[str, ...] = ()
    modes: bool = False
    group_state: tuple[str, ...] = ()


_GROUP_STATE = ("k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")
_SCHEDULE_FREE = IterateSpec(state_keys=("z",), group_keys=("weight_sum", "lr_max"), modes=True,
                             group_state=_GROUP_STATE)
# the closure forms have no train / eval modes; the reference forms keep y and x as state too
_CLOSURE = IterateSpec(state_keys=("z",), group_keys=("weight_sum", "lr_max"), group_state=_GROUP_STATE)
_REFERENCE = IterateSpec(state_keys=("z", "x", "y"), group_keys=("weight_sum", "lr_max"), modes=True,
                         group_state=_GROUP_STATE)
KNOWN: dict[str, IterateSpec] = {
    **{base: _SCHEDULE_FREE for base in ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree")},
    **{base + "Closure": _CLOSURE for base in ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree")},
    **{base + "Reference": _REFERENCE for base in ("AdamWScheduleFree", "SGDScheduleFree")},
}


def spec_for(optimizer: Any) -> IterateSpec | None:
    """The optimizer's (an instance or a class) :class:`IterateSpec`: its
    ``hdet_iterates`` attribute, else the entry of :data:`KNOWN` for its class (or a base
    class) name; ``None`` for an optimizer with one iterate (AdamW, SGD...)."""
    declared = getattr(optimizer, "hdet_iterates", None)
    if declared is not None:
        return declared
    for cls in (optimizer if isinstance(optimizer, type) else type(optimizer)).__mro__:
        if cls.__name__ in KNOWN:
            return KNOWN[cls.__name__]
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 keeps optimizer state as DTensors sharded like the parameter: this rank's shard.
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """This process' local iterate state tensors, in param-group then parameter order
    (the same order on every replica of the same model), for the keys of
    :func:`spec_for`; empty when the optimizer has none or has not stepped yet (the state
    is created at the first step, at the same step on every replica)."""
    spec = spec_for(optimizer)
    if spec is None or not spec.state_keys:
        return []
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out += [_local(state[k]) for k in spec.state_keys if k in state]
    return out


def group_scalars(optimizer: Any) -> list[float]:
    """The group scalars converge averages (:attr:`IterateSpec.group_keys`), group by
    group, as floats."""
    spec = spec_for(optimizer)
    if spec is None:
        return []
    return [float(g[k]) for g in optimizer.param_groups for k in spec.group_keys if k in g]


def set_group_scalars(optimizer: Any, values: list[float]) -> None:
    """Write back :func:`group_scalars`' values (same order)."""
    spec = spec_for(optimizer)
    it = iter(values)
    for g in optimizer.param_groups if spec is not None else ():
        for k in spec.group_keys:
            if k in g:
                g[k] = next(it)


def has_modes(optimizer: Any) -> bool:
    """The optimizer (an instance or a class) switches its parameters between train and
    eval points."""
    spec = spec_for(optimizer)
    return bool(spec is not None and spec.modes)


def in_train_mode(optimizer: Any) -> bool:
    """The parameters hold the training point (always true for an optimizer without modes)."""
    return not has_modes(optimizer) or all(g.get("train_mode", True) for g in optimizer.param_groups)


def switch_(optimizer: Any, to_eval: bool) -> None:
    """``optimizer.eval()`` or ``.train()``, leaving no empty state behind: schedule-free's
    switch reads ``optimizer.state[p]`` of every parameter, and that defaultdict then
    holds an empty entry for each parameter not yet stepped, which torch's state-dict
    API (``_init_optim_state``, DCP) takes for existing state and skips creating the real
    one: a resume would then load no ``z``."""
    (optimizer.eval if to_eval else optimizer.train)()
    for p in [p for p, st in optimizer.state.items() if not st]:
        del optimizer.state[p]


def train_mode_(optimizer: Any) -> None:
    """Put an optimizer with modes in train mode (schedule-free optimizers start in eval
    mode and refuse to step there); nothing for others."""
    if has_modes(optimizer) and not in_train_mode(optimizer):
        switch_(optimizer, to_eval=False)


@contextlib.contextmanager
def eval_mode(optimizer: Any, refresh: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside, the parameters hold the evaluation point x (``optimizer.eval()``); on exit
    the training point y again (``optimizer.train()``). ``refresh``: called after each
    switch, for engines whose forward reads a working copy of what the optimizer changed
    (ZeRO-3's partitions, fairscale OSS's broadcast). Nothing happens for an optimizer
    without modes or one already in eval mode.

    The round trip y -> x -> y is two lerps in floating point: y may change in its last
    bits, the same way on every replica and in the ``Simulator``.
    """
    if not (has_modes(optimizer) and in_train_mode(optimizer)):
        yield
        return
    switch_(optimizer, to_eval=True)
    if refresh is not None:
        refresh()
    try:
        yield
    finally:
        switch_(optimizer, to_eval=False)
        if refresh is not None:
            refresh()


def schedule_warning(optimizer: Any, schedule: str) -> str | None:
    """A message when an optimizer (instance or class) with an evaluation point
    (schedule-free) runs under an
    HDET schedule that warms up or decays (``schedule``: ``hdet.schedule.name``): it
    warms up itself (its ``warmup_steps``) and needs no decay, so the two would compound;
    ``None`` otherwise."""
    if not has_modes(optimizer) or schedule == "constant":
        return None
    name = (optimizer if isinstance(optimizer, type) else type(optimizer)).__name__
    return (f"hdet.schedule.name: {schedule!r} under {name}, which warms up itself (its "
            "warmup_steps) and needs no decay: the LR it reads would be shaped twice; set hdet.schedule.name="
            "'constant' (with no warmup_steps of its own)")

