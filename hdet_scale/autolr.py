"""The auto-LR controller's state and update over every explored (axis, group) pair.

The arithmetic is in :mod:`hdet_scale.controller` (pure); this module keeps the state
(velocity, the paper controller's base values, the log controller's multipliers), knows
which update each key gets, and publishes what it did for logging. No collectives: every
rank feeds it the same all-reduced fitness vector and so reaches the same values.

Two controllers (``hdet.auto.controller``; docs/quality.md measures both):

- ``"log"`` (default): ``value(t) = raw(t) * m`` with ``raw`` the schedule's LR (or the
  optimizer's initial value for other axes) and ``log m`` moved at each sync by
  ``controller.log_update``. The user's schedule keeps its shape, warm-up and decay.
- ``"paper"`` (paper Sec. 3.3, Alg. 1): after the first meta-update the base value is
  ``h <- h (1 - gamma) + lambda v``, piecewise constant between syncs, floored at the
  schedule's final LR or ``peak / max_factor``, whichever is lower (:func:`lr_lower_bound`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

from hdet_scale import axes as ax
from hdet_scale import axis_specs as specs
from hdet_scale import controller as ctl
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.schedules import Constant, Cosine, OneCycle, Schedule

Key = tuple[str, int]


def build_schedule(cfg: HDETConfig) -> Schedule:
    s = cfg.schedule
    if s.name == "onecycle":
        return OneCycle(s.total_steps, s.pct_start, s.anneal_strategy, s.div_factor, s.final_div_factor,
                        s.three_phase, s.base_momentum, s.max_momentum)
    if s.name == "cosine":
        return Cosine(s.total_steps, s.warmup_steps, s.min_ratio)
    return Constant(s.total_steps, s.warmup_steps)


def decay_for(cfg: HDETConfig, schedule: Schedule, axis: str, peak: float) -> float:
    """gamma of one explored (axis, group) under the ``"paper"`` controller:
    ``hdet.auto.decay`` if given, else derived (``controller.derive_decay``) so that the
    LR base reaches the schedule's floor at the last sync. 0 for the ``"log"`` controller
    (it follows the schedule's own decay) and for axes without a schedule.

    K counts the syncs from the first meta-update to ``total_steps`` inclusive.

    Raises:
        HDETConfigError: a derived gamma outside [0, 1).
    """
    auto = cfg.auto
    if not (auto.enabled and cfg.axis_auto(axis)) or auto.controller != "paper":
        return 0.0
    if not isinstance(auto.decay, str):
        return float(auto.decay)
    if axis != "lr":
        return 0.0
    T, total = cfg.sync_interval, cfg.schedule.total_steps
    first = cfg.first_meta_step
    k_syncs = (total - first) // T + 1 if first <= total else 0
    return ctl.derive_decay(schedule.value(min(first, total), peak), schedule.floor(peak), k_syncs)


def drowning_warning(cfg: HDETConfig, gamma: float) -> str | None:
    """A message when the paper controller's decay per sync exceeds the largest relative
    move its meta-update can make (``lambda * alpha``: all softmax weight on the largest
    replica value), i.e. the decay alone sets the LR; ``None`` otherwise."""
    alpha = cfg.axes["lr"].spread_ratio
    most = cfg.auto.resolved("step_size") * alpha
    if gamma <= most or alpha == 0:
        return None
    return (f"hdet.auto: the decay (auto.decay={cfg.auto.decay!r}) cuts the base LR by {100 * gamma:.1f}% per sync, while the "
            f"meta-update can move it by at most {100 * most:.2f}% (step_size {cfg.auto.resolved('step_size')} x "
            f"spread_ratio {alpha}): the 'paper' controller will act as a piecewise-constant decay. Use "
            "auto.controller='log' (follows the schedule), or a longer run / later warm-up / explicit auto.decay")


def controller_warning(cfg: HDETConfig, gamma: float | None) -> str | None:
    """What the controller built from ``cfg`` warns of at its start, or ``None``:
    auto-LR with nothing to compare (:attr:`HDETConfig.auto_without_spread_warning`, or
    no controlled axis with a spread), or the ``"paper"`` controller's decay ``gamma``
    (the LR's, ``None``: no LR group explored) outrunning its meta-update
    (:func:`drowning_warning`). :func:`check_config` gives it before anything starts
    (``hdet-train`` prints the checks' warnings there, where this one, raised only in
    the ranks, would be dropped), the :class:`Controller` where it is built alone."""
    if cfg.auto_without_spread_warning:
        return cfg.auto_without_spread_warning
    if not cfg.auto.enabled:
        return None
    if not cfg.auto_can_move:
        return ("hdet.auto.enabled: no axis it controls has a spread (spread_ratio > 0) over more than one replica, "
                "so the meta-update has no signal and leaves the LR to the schedule"
                + (" and the decay" if cfg.auto.controller == "paper" else ""))
    if cfg.auto.controller == "paper" and gamma is not None:
        return drowning_warning(cfg, gamma)
    return None


def lr_lower_bound(schedule: Schedule, peak: float, max_factor: float) -> float:
    """The lowest base LR the ``"paper"`` controller may set for a group whose peak LR
    is ``peak``: the schedule's final LR (``schedule.floor``), or ``peak / max_factor``
    when that is lower. A schedule that does not decay (``constant``; ``cosine`` with
    ``min_ratio`` 1) ends at its peak: flooring there would let auto-LR raise the LR but
    never lower it. ``max_factor`` bounds the ``"log"`` controller's multiplier the same
    way (``[1/max_factor, max_factor]``)."""
    return min(schedule.floor(peak), peak / max_factor)


def _warn_once(msg: str) -> None:
    # check_config and the Controller both meet this (initialize runs one, then builds the
    # other): warned from this one line, Python's default filter shows the text once.
    warnings.warn(msg, UserWarning, stacklevel=1)


def check_config(cfg: HDETConfig) -> None:
    """Checks that need the schedule (the derived decay) without an optimizer: the ratio
    floor/start does not depend on the peak, so peak 1.0 stands for every group. Pure;
    raises HDETConfigError. Warns (``UserWarning``) when one replica is asked to do what
    takes two (:attr:`HDETConfig.single_replica_warning`), and when auto-LR is on with
    nothing to compare, or the ``"paper"`` controller's decay outruns it
    (:func:`controller_warning`)."""
    msg = cfg.single_replica_warning
    if msg:
        warnings.warn(msg, UserWarning, stacklevel=2)
    if cfg.auto_off_warning:
        _warn_once(cfg.auto_off_warning)
    if cfg.schedule_unused_warning:
        _warn_once(cfg.schedule_unused_warning)
    schedule = build_schedule(cfg)
    decays = {axis: decay_for(cfg, schedule, axis, 1.0) for axis in cfg.axes}
    msg = controller_warning(cfg, decays.get("lr"))
    if msg:
        _warn_once(msg)


def check_additive_floors(cfg: HDETConfig, schedule: Schedule, bases: dict[Key, float], prefix: str = "hdet") -> None:
    """An additive axis moves each replica's value by up to ``spread_ratio`` either way: a
    learning rate or a weight decay taken below 0 by it would train with a negative value,
    silently. A multiplicative axis on a value of 0 gives every replica 0: nothing is
    explored, silently. ``bases``: ``{(axis, group): value}``, the LR's peak or the
    optimizer's value for other axes (the LR axis is multiplicative only, so only its
    zero peak matters; ``schedule`` is kept for that reading). Pure.

    Raises:
        HDETConfigError: every (axis, group) whose lowest replica value would be < 0, or
            that a multiplicative spread of 0 leaves unexplored.

    Warns (``UserWarning``): a multiplicative axis with some groups at 0 beside others
    (those stay at 0 in every replica).
    """
    errors = []
    for (axis, group), base in sorted(bases.items()):
        spec = cfg.axes.get(axis)
        if spec is None or spec.spread_ratio <= 0 or cfg.replicas < 2:
            continue
        if spec.kind == "multiplicative":
            # every multiplier times 0 is 0: an axis whose every explored group is at 0
            # explores nothing; a group at 0 beside others (a no-decay
            # group of biases and norms) is meant to stay there
            at_zero = [g for (a, g), v in sorted(bases.items()) if a == axis and v == 0]
            if base == 0 and all(v == 0 for (a, _), v in bases.items() if a == axis) and \
                    group == min(g for a, g in bases if a == axis):
                an = "an" if axis[0] in "aeiou" else "a"  # "an eps"
                errors.append(f"{prefix}.axes.{axis}: a multiplicative spread of {an} {axis} of 0 gives every "
                              f"replica 0, so nothing is explored: set {an} {axis} > 0 in the optimizer "
                              "(optimizer.params), or kind additive")
            elif base == 0 and group == at_zero[0]:
                # HDETTrainer's no-decay group logs group_1 = 0 for every replica; kept
                # at 0 on purpose, but said once so it is no surprise
                others = [g for a, g in sorted(bases) if a == axis and g not in at_zero]
                warnings.warn(f"{prefix}.axes.{axis}: parameter group(s) {at_zero} have {axis} 0 (a no-decay group: "
                              f"biases, norms), which a multiplicative spread keeps at 0 in every replica: only "
                              f"group(s) {others} are explored; set axes.{axis}.groups={others} to say so",
                              UserWarning, stacklevel=3)
            continue
        if spec.kind != "additive":
            continue
        lowest = base  # the LR axis is multiplicative only (config.py): no schedule to follow here
        if lowest - spec.spread_ratio < 0:
            where = f"its {axis}"
            errors.append(f"{prefix}.axes.{axis}.spread_ratio: an additive spread of {spec.spread_ratio:g} takes "
                          f"parameter group {group} from {where} {lowest:g} to {lowest - spec.spread_ratio:g} for one "
                          f"replica, and {axis} must stay >= 0: "
                          + (f"use spread_ratio <= {lowest:g}, kind multiplicative, or a larger base value"
                             if lowest > 0 else  # at 0, two of the three ways out would be dead ends
                             f"set {axis} >= {spec.spread_ratio:g} in the optimizer (optimizer.params)"))
    errors += specs.check_group_bounds(cfg, bases, prefix)  # beta2 near 1, a user's bounds
    if errors:
        raise HDETConfigError("invalid hdet config:\n  " + "\n  ".join(errors))


def interval_decayed(schedule: Schedule, start: int, end: int) -> bool:
    """True when ``schedule`` is lower at an interval's last step than at its first: the
    interval ran the optimizer steps ``start .. end - 1`` (0-based, the indices
    ``schedule.value`` takes). Where ``auto.decay_moves`` applies."""
    return end - 1 > start and schedule.value(end - 1, 1.0) < schedule.value(start, 1.0)


class Controller:
    """Auto-LR state for the explored keys of one scheduler.

    Args:
        config: the parsed block.
        schedule: the LR base schedule.
        peaks: peak LR per parameter group.
        explored: the (axis, group) pairs explored (``hdet.axes``).

    Attributes:
        base: ``{key: value}`` of the ``"paper"`` controller once it has run (empty
            before, and always for ``"log"``).
        log_m: ``{key: log multiplier}`` (``"log"``; multiplicative axes) or
            ``{key: shift}`` (additive axes), 0 until the first meta-update.
        velocity: ``{key: v}``; ``decay``: ``{key: gamma}`` (``"paper"``).
    """

    def __init__(self, config: HDETConfig, schedule: Schedule, peaks: list[float], explored: list[Key]) -> None:
        self.config = config
        self.auto = config.auto
        self.schedule = schedule
        self.peaks = peaks
        self.explored = explored
        self.base: dict[Key, float] = {}
        self.log_m: dict[Key, float] = {k: 0.0 for k in explored}
        self.velocity: dict[Key, float] = {k: 0.0 for k in explored}
        self.decay = {(a, g): decay_for(config, schedule, a, peaks[g]) for a, g in explored}
        self.updates = 0
        gammas = [v for (a, _), v in self.decay.items() if a == "lr"]
        msg = controller_warning(config, max(gammas) if gammas else None)
        if msg:
            _warn_once(msg)

    @property
    def active(self) -> bool:
        """True once the first meta-update has run."""
        return self.updates > 0

    def value(self, key: Key, raw: float) -> float:
        """The shared (un-spread) value of ``key`` given its un-controlled value ``raw``
        (the schedule's LR at this step, or the optimizer's initial value)."""
        if key in self.base:
            return self.base[key]
        shift = self.log_m.get(key, 0.0)
        if shift == 0.0:
            return raw
        spec = self.config.axes[key[0]]
        # every replica stays inside the axis' bounds (for an additive axis with the
        # default lower bound 0: the value stays >= spread_ratio); the raw value itself
        # was checked at the start, and a schedule may take it where it likes
        lo, hi = specs.base_limits(key[0], spec)
        moved = raw + shift if spec.kind == "additive" else raw * math.exp(shift)
        return min(max(moved, min(raw, lo)), max(raw, hi))

    def update(self, fitness: list[float], permutations: dict[Key, list[int]], applied: dict[Key, list[float]],
               current: Callable[[Key], float], record: dict[str, Any],
               raw: Callable[[Key], float] | None = None, noise: float | None = None,
               interval: tuple[int, int] | None = None) -> None:
        """One meta-update from the replicas' ``fitness`` (length R, lower is better,
        non-finite allowed). ``permutations`` and ``applied`` are those the interval ran
        with; ``current(key)`` the shared value now. Writes ``hdet/weight/replica_<r>``,
        ``hdet/temperature`` (and ``hdet/fitness_noise`` when measured) and per key
        ``hypergradient``, ``velocity`` (and ``multiplier`` or ``floored``) into
        ``record``. ``noise``: the standard error of the fitness gaps
        (``controller.fitness_noise``), which an automatic temperature takes in.
        ``interval``: ``(start, end)``, the optimizer steps the interval ran
        (:func:`interval_decayed`); where the schedule fell over it the LR multiplier moves
        as ``auto.decay_moves`` allows (a refused move logs ``hdet/lr/group_<g>/held`` = 1)."""
        auto = self.auto
        decaying = interval is not None and interval_decayed(self.schedule, *interval)
        temp = auto.resolved("temperature")
        temp = ctl.auto_temperature(fitness, noise, auto.noise_scale) if temp == "auto" else float(temp)
        if noise is not None:
            record["hdet/fitness_noise"] = noise
        weights = ctl.softmax_weights(fitness, temp)
        if not any(weights.finite):
            # a probe that returns NaN at every sync would otherwise move nothing without a word
            _warn_once("auto-LR: no replica had a finite fitness at a meta-update (every probe or interval loss was "
                       "NaN or inf): its weights are 0 and nothing moved; check the probe (hdet_scale.initialize's "
                       "probe, or auto.fitness) or the loss itself. Said once; hdet/weight/replica_<r> logs each sync")
        record["hdet/temperature"] = temp
        for r, w in enumerate(weights.weights):
            record[f"hdet/weight/replica_{r}"] = w
        momentum, step = auto.resolved("momentum"), auto.resolved("step_size")
        offsets = ax.spread_offsets(len(fitness))
        for key in self.explored:
            a, g = key
            if not self.config.axis_auto(a):
                continue
            if auto.controller == "paper":
                delta = ctl.hypergradient(weights, applied[key])
                new_base, self.velocity[key] = ctl.meta_update(current(key), self.velocity[key], delta, momentum,
                                                               step, self.decay[key])
                # The velocity remembers larger, older bases; under a strong decay it can
                # outweigh base * (1 - gamma) and send the LR below zero. Floor: see
                # lr_lower_bound (0 for other multiplicative axes).
                # Bounds (axis_specs.base_limits): an additive spread reaches base -
                # spread_ratio, so with the lower bound 0 the base stays >= spread_ratio.
                floor, ceiling = self._base_limits(key)
                if new_base < floor:
                    new_base = floor
                    record[f"hdet/{a}/group_{g}/floored"] = 1
                elif new_base > ceiling:
                    new_base = ceiling
                    record[f"hdet/{a}/group_{g}/ceiled"] = 1
                self.base[key] = new_base
            else:
                axis = self.config.axes[a]
                # No spread, no signal: fitness gaps are then noise alone.
                delta = (ctl.normalized_hypergradient(weights, [offsets[p] for p in permutations[key]])
                         if axis.spread_ratio > 0 else 0.0)
                if axis.kind == "multiplicative":  # log units, bounded by max_factor
                    before = self.log_m[key], self.velocity[key]
                    self.log_m[key], self.velocity[key] = ctl.log_update(
                        self.log_m[key], self.velocity[key], delta, momentum, step, auto.max_factor)
                    if a == "lr" and decaying and auto.decay_moves != "both" and (
                            auto.decay_moves == "hold" or self.log_m[key] < before[0]):
                        # the short-horizon bias (AutoConfig.decay_moves): a down move
                        # here is what any decay shows over one interval; the velocity
                        # keeps no downward pull to release after the decay
                        self.log_m[key] = before[0]
                        self.velocity[key] = before[1] if auto.decay_moves == "hold" else max(self.velocity[key], 0.0)
                        record[f"hdet/{a}/group_{g}/held"] = 1
                    # held at max_factor: said like a bound, so a multiplier stopped there
                    # is visible
                    if abs(self.log_m[key]) == math.log(auto.max_factor):
                        side = "ceiled" if self.log_m[key] > 0 else "floored"
                        record[f"hdet/{a}/group_{g}/{side}"] = 1
                else:  # a shift, in units of the axis' spread
                    moved, self.velocity[key] = ctl.log_update(0.0, self.velocity[key], delta, momentum, step,
                                                               math.inf)
                    self.log_m[key] += axis.spread_ratio * moved
                if raw is not None and a != "lr":
                    self._hold_in_bounds(key, raw(key), record)
                record[f"hdet/{a}/group_{g}/multiplier"] = (math.exp(self.log_m[key]) if axis.kind == "multiplicative"
                                                            else self.log_m[key])
            record[f"hdet/{a}/group_{g}/hypergradient"] = delta
            record[f"hdet/{a}/group_{g}/velocity"] = self.velocity[key]
        self.updates += 1

    def _hold_in_bounds(self, key: Key, raw: float, record: dict[str, Any]) -> None:
        """"log": keep the multiplier (shift) of a non-LR axis where its value's whole
        spread stays in the bounds (``raw``: the axis' constant un-controlled value), so
        the logged multiplier is the one used and does not wind up beyond the bound while
        the value is held; records ``floored`` / ``ceiled`` as the "paper" branch does."""
        a, g = key
        spec = self.config.axes[a]
        lo, hi = specs.base_limits(a, spec)
        if spec.kind == "additive":
            low, high = lo - raw, hi - raw
        elif raw > 0:
            low = math.log(lo / raw) if lo > 0 else -math.inf
            high = math.log(hi / raw) if math.isfinite(hi) else math.inf
        else:
            return
        if self.log_m[key] < low:
            self.log_m[key] = low
            record[f"hdet/{a}/group_{g}/floored"] = 1
        elif self.log_m[key] > high:
            self.log_m[key] = high
            record[f"hdet/{a}/group_{g}/ceiled"] = 1

    def state_dict(self) -> dict[str, Any]:
        return {"base": dict(self.base), "log_m": dict(self.log_m), "velocity": dict(self.velocity),
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = dict(state["base"])
        self.log_m = dict(state["log_m"])
        self.velocity = dict(state["velocity"])
        self.updates = int(state["updates"])
        self._clamp_restored()

    def _base_limits(self, key: Key) -> tuple[float, float]:
        """The ``"paper"`` base's ``(floor, ceiling)``: the axis' limits
        (``axis_specs.base_limits``), for the LR floored at :func:`lr_lower_bound`."""
        a, g = key
        floor, ceiling = specs.base_limits(a, self.config.axes[a])
        if a == "lr":
            floor = max(floor, lr_lower_bound(self.schedule, self.peaks[g], self.auto.max_factor))
        return floor, ceiling

    def _clamp_restored(self) -> None:
        """Hold restored values inside this run's bounds (``auto.max_factor``, the LR
        floor, an axis' limits), which a resume may have tightened. Without it the
        checkpoint's multiplier runs past the new bound until the next sync (e.g. 1.27
        under a new ``max_factor`` of 1.1, for up to ``sync_interval`` steps) while the
        resume warning says the new value applies. Values inside the bounds,
        every value of an unchanged config, are left exactly as saved."""
        for key in self.explored:
            spec = self.config.axes[key[0]]
            if key in self.base:
                floor, ceiling = self._base_limits(key)
                self.base[key] = min(max(self.base[key], floor), ceiling)
            elif key in self.log_m and spec.kind == "multiplicative":
                bound = math.log(self.auto.max_factor)
                self.log_m[key] = min(max(self.log_m[key], -bound), bound)
