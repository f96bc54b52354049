"""The optimizer's parameter groups as the HDET scheduler sees them: read live (a loaded
optimizer rebinds them), and checked against the ``hdet`` config before anything is built."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hdet_scale.axis_specs import group_has, is_model_axis
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError


class LiveParamGroups(Mapping):
    """``{replica_index: optimizer.param_groups}`` read at every access.

    ``Optimizer.load_state_dict`` (also inside DeepSpeed's ``engine.load_checkpoint``)
    rebinds ``param_groups`` to new dicts: a list stored at start-up would go stale and
    the scheduler would set hyperparameters the optimizer no longer reads.

    Args:
        optimizers: ``{replica_index: optimizer}`` for the replicas this process drives.
    """

    def __init__(self, optimizers: Mapping[int, Any]) -> None:
        self._optimizers = dict(optimizers)

    def __getitem__(self, key: int) -> list[dict]:
        return self._optimizers[key].param_groups

    def __iter__(self) -> Iterator[int]:
        return iter(self._optimizers)

    def __len__(self) -> int:
        return len(self._optimizers)


def check_group_count(config: HDETConfig, count: int) -> None:
    """The checks of ``config`` that need only the number of parameter groups: a
    ``max_lr`` list has one value per group and every explored group index exists. For a
    trainer that knows how many groups it will build (``hdet-train``: one) and refuses
    before anything starts; :func:`check_param_groups` runs them too.

    Raises:
        HDETConfigError: naming ``hdet.schedule.max_lr`` or ``hdet.axes.<axis>.groups``.
    """
    m = config.schedule.max_lr
    if isinstance(m, list) and len(m) != count:
        raise HDETConfigError(f"hdet.schedule.max_lr: {len(m)} values for {count} parameter groups")
    for name, axis in sorted(config.axes.items()):
        if is_model_axis(name):
            continue  # lives in the model (hdet_scale.model_axes), not in the param groups
        for g in axis.groups or []:
            if g >= count:
                raise HDETConfigError(f"hdet.axes.{name}.groups: group {g} does not exist "
                                      f"(the optimizer has {count} parameter groups)")


def check_param_groups(config: HDETConfig, groups: list[dict]) -> None:
    """The checks of ``config`` against an optimizer's param groups, without building
    anything (so a backend runs them before its first collective): every explored
    group index exists and holds the explored hyperparameter, and a ``max_lr`` list
    has one value per group. Raises HDETConfigError naming the key."""
    check_group_count(config, len(groups))
    for name, axis in sorted(config.axes.items()):
        if is_model_axis(name):
            continue
        for g, grp in enumerate(groups):
            if not group_has(grp, name):
                needs = "'betas' (two values)" if name == "beta2" else f"'{name}'"
                raise HDETConfigError(f"hdet.axes.{name}: parameter group {g} has no {needs} "
                                      f"(keys: {sorted(k for k in grp if k != 'params')})")
