"""What each explorable hyperparameter is: where it lives, its valid range, its bounds.

Two sides (HDET.md "Beyond learning rate"; the paper names LR, weight decay, dropout,
attention temperature and label smoothing):

* optimizer-side axes live in the optimizer's parameter groups, one value per group:
  ``lr``, ``weight_decay``, ``eps`` (keys of the same name) and ``beta2`` (the second
  entry of Adam's ``betas``). Their base value is the group's own.
* model-side axes live in the model or its loss, one value per replica:
  ``dropout`` (every ``nn.Dropout`` and attention dropout, or a named subset),
  ``temperature`` (attention softmax temperature) and ``label_smoothing`` (read by the
  loss). Their base value is ``hdet.axes.<name>.value``; they are set through
  :mod:`hdet_scale.model_axes`.

Bounds: every replica's value of an axis stays inside ``[lo, hi]`` (``bounds`` in the
axis' block, default :data:`DEFAULT_BOUNDS`). The base value is kept where its whole
spread fits (:func:`base_limits`), not the replicas clipped one by one: clipping would
break the symmetric spread whose weighted mean is the hypergradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

OPTIMIZER_AXES = ("lr", "weight_decay", "beta2", "eps")
MODEL_AXES = ("dropout", "temperature", "label_smoothing")
AXIS_NAMES = OPTIMIZER_AXES + MODEL_AXES
# Axes whose setter walks the model's modules (``modules`` selects a subset of them).
MODULE_AXES = ("dropout", "temperature")

INF = math.inf
# The values that mean something: (lo, hi, hi_inclusive). A user's bounds must lie inside.
DOMAIN = {"lr": (0.0, INF, True), "weight_decay": (0.0, INF, True), "eps": (0.0, INF, True),
          "beta2": (0.0, 1.0, False), "dropout": (0.0, 1.0, False), "label_smoothing": (0.0, 1.0, False),
          "temperature": (0.0, INF, True)}
# Default [lo, hi] (closed) every replica's value stays in. Upper ends below 1 keep a
# replica off the degenerate ends (dropout 1 zeroes a layer; beta2 1 never forgets);
# the temperature's lower end keeps the attention scale finite.
DEFAULT_BOUNDS = {"lr": (0.0, INF), "weight_decay": (0.0, INF), "eps": (0.0, INF), "beta2": (0.0, 0.99999),
                  "dropout": (0.0, 0.9), "label_smoothing": (0.0, 0.9), "temperature": (1e-2, 1e2)}
# Base value of a model-side axis when ``value`` is not given (dropout has none: say it).
DEFAULT_VALUE = {"temperature": 1.0, "label_smoothing": 0.0}


def is_model_axis(name: str) -> bool:
    return name in MODEL_AXES


def bounds(name: str, axis: Any) -> tuple[float, float]:
    """``[lo, hi]`` of ``axis`` (its ``bounds`` or the default)."""
    return tuple(float(v) for v in axis.bounds) if axis.bounds is not None else DEFAULT_BOUNDS[name]


def model_value(name: str, axis: Any) -> float | None:
    """The base value of a model-side axis at step 0 (``None``: dropout without ``value``)."""
    return float(axis.value) if axis.value is not None else DEFAULT_VALUE.get(name)


def spread_range(kind: str, spread: float, base: float) -> tuple[float, float]:
    """The lowest and highest replica value around ``base``."""
    if kind == "multiplicative":
        return base * (1 - spread), base * (1 + spread)
    return base - spread, base + spread


def base_limits(name: str, axis: Any) -> tuple[float, float]:
    """The range of base values whose whole spread stays in :func:`bounds`."""
    lo, hi = bounds(name, axis)
    a = axis.spread_ratio
    if axis.kind == "multiplicative":
        return (lo / (1 - a) if lo > 0 else lo), (hi / (1 + a) if math.isfinite(hi) else hi)
    return lo + a, hi - a


def clamp(value: float, limits: tuple[float, float]) -> float:
    return min(max(value, limits[0]), limits[1])


# ---- optimizer parameter groups -------------------------------------------------------
def group_has(group: dict, name: str) -> bool:
    if name == "beta2":
        return isinstance(group.get("betas"), (tuple, list)) and len(group["betas"]) == 2
    return name in group


def read(group: dict, name: str) -> float:
    """The value of optimizer-side axis ``name`` in one parameter group."""
    return float(group["betas"][1]) if name == "beta2" else float(group[name])


def write(group: dict, name: str, value: float) -> None:
    if name == "beta2":
        group["betas"] = (group["betas"][0], value)
    else:
        group[name] = value


# ---- config checks ---------------------------------------------------------------------
def validate(name: str, axis: Any, key: str, errors: list[str], check: Callable[..., None]) -> None:
    """The checks of one axis' block that need its name (``check(errors, ok, key, msg)``)."""
    model = is_model_axis(name)
    if axis.groups is not None and model:
        check(errors, False, f"{key}.groups", f"{name} is a model-side axis (one value per replica, not per "
              "parameter group): leave groups out")
    if axis.value is not None and not model:
        check(errors, False, f"{key}.value", f"{name} is read from the optimizer's parameter groups; set it in "
              "the optimizer (value is for dropout, temperature, label_smoothing)")
    if axis.modules is not None:
        check(errors, name in MODULE_AXES, f"{key}.modules", f"only dropout and temperature set modules; "
              f"{name} has none")
        check(errors, len(axis.modules) > 0 and all(m.strip() for m in axis.modules), f"{key}.modules",
              f"must be a non-empty list of module-name patterns (fnmatch, e.g. 'model.layers.*.self_attn') "
              f"or null, got {axis.modules}")
    dlo, dhi, closed = DOMAIN[name]
    interval = f"[{dlo:g}, {dhi:g}{']' if closed else ')'}"
    bounds_ok = True
    if axis.bounds is not None and name == "lr":
        # the LR's base follows hdet.schedule, which bounds would cut: refused, not half-kept
        check(errors, False, f"{key}.bounds", "the lr axis follows hdet.schedule (its peak, min_ratio / "
              "final_div_factor) and auto.max_factor: bound it there")
        bounds_ok = False
    elif axis.bounds is not None:
        b = axis.bounds
        bounds_ok = (len(b) == 2 and all(not math.isnan(v) for v in b) and b[0] < b[1] and b[0] >= dlo
                     and (b[1] <= dhi if closed else b[1] < dhi) and not (name == "temperature" and b[0] <= 0))
        check(errors, bounds_ok, f"{key}.bounds", f"must be [lo, hi] with lo < hi inside {name}'s range "
              f"{interval}{' (lo > 0)' if name == 'temperature' else ''}, got {b}")
    if not model or not bounds_ok:
        return
    value = model_value(name, axis)
    if value is None:
        check(errors, False, f"{key}.value", f"required: the {name} probability the replicas spread around "
              "(e.g. 0.1)")
        return
    if not math.isfinite(value):  # not "puts replicas in [inf, inf]"
        check(errors, False, f"{key}.value", f"must be a finite number, got {value}")
        return
    if axis.kind == "multiplicative" and value == 0 and axis.spread_ratio > 0:
        # additive around 0 is no way out where the lower bound is above 0 (temperature)
        additive = "use kind additive, or " if bounds(name, axis)[0] <= 0 else "use "
        check(errors, False, f"{key}.kind", f"a multiplicative spread of a {name} of 0 gives every replica 0, so "
              f"nothing is explored: {additive}a {name} > 0 ({key}.value"
              f"{', or model.dropout in hdet-train' if name == 'dropout' else ''})")
        return
    lo, hi = bounds(name, axis)
    low, high = spread_range(axis.kind, axis.spread_ratio, value)
    check(errors, math.isfinite(value) and lo <= low and high <= hi, f"{key}.value",
          f"{value:g} with spread_ratio {axis.spread_ratio:g} ({axis.kind}) puts replicas in "
          f"[{low:g}, {high:g}], outside bounds [{lo:g}, {hi:g}]")


def check_group_bounds(cfg: Any, bases: dict[tuple[str, int], float], prefix: str = "hdet") -> list[str]:
    """Optimizer-side axes whose spread around the optimizer's value leaves the bounds
    (a lower bound of 0 is :func:`hdet_scale.autolr.check_additive_floors`' to report)."""
    errors = []
    for (name, group), base in sorted(bases.items()):
        axis = cfg.axes.get(name)
        if axis is None or is_model_axis(name) or cfg.replicas < 2 or axis.spread_ratio <= 0:
            continue
        lo, hi = bounds(name, axis)
        low, high = spread_range(axis.kind, axis.spread_ratio, base)
        if (low < lo and lo > 0) or high > hi:
            errors.append(f"{prefix}.axes.{name}: the optimizer's {name} {base:g} (parameter group {group}) with "
                          f"spread_ratio {axis.spread_ratio:g} ({axis.kind}) puts replicas in [{low:g}, {high:g}], "
                          f"outside bounds [{lo:g}, {hi:g}]")
    return errors
