"""Base schedules: the shared value ``eta(t)`` that every replica scales by its multiplier.

Pure functions of the optimizer step (never micro-batches). ``OneCycle`` reproduces
``torch.optim.lr_scheduler.OneCycleLR`` bit for bit: same phase boundaries, same float
operations in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _anneal(strategy: str, start: float, end: float, pct: float) -> float:
    # Same expressions as OneCycleLR._annealing_cos / _annealing_linear.
    if strategy == "cos":
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return (end - start) * pct + start


@dataclass(frozen=True)
class OneCycle:
    """``torch.optim.lr_scheduler.OneCycleLR`` as a pure function.

    Args:
        total_steps: optimizer steps in the run (the schedule is defined on
            ``0 .. total_steps``, as in torch).
        pct_start, anneal_strategy, div_factor, final_div_factor, three_phase: as in
            torch (Smith & Topin 2017, "Super-Convergence").
        base_momentum, max_momentum: the beta1 / momentum cycle (used only when the
            caller cycles momentum).

    ``value(step, peak)`` is the LR of a parameter group whose ``max_lr`` is ``peak``:
    it starts at ``peak / div_factor``, reaches ``peak`` and ends at
    ``peak / div_factor / final_div_factor``.
    """

    total_steps: int
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False
    base_momentum: float = 0.85
    max_momentum: float = 0.95

    def _phases(self) -> list[tuple[float, str, str]]:
        n = self.total_steps
        p = self.pct_start
        if self.three_phase:
            return [
                (float(p * n) - 1, "initial", "max"),
                (float(2 * p * n) - 2, "max", "initial"),
                (n - 1, "initial", "min"),
            ]
        return [(float(p * n) - 1, "initial", "max"), (n - 1, "max", "min")]

    def _interp(self, step: int, points: dict[str, float], momentum: bool) -> float:
        if step > self.total_steps:
            raise ValueError(f"step {step} is past the schedule's total_steps={self.total_steps}")
        phases = self._phases()
        start_step = 0.0
        for i, (end_step, start, end) in enumerate(phases):
            if step <= end_step or i == len(phases) - 1:
                pct = (step - start_step) / (end_step - start_step)
                if momentum:
                    # beta1 moves opposite to the LR: high when the LR is low.
                    start, end = ({"initial": "max", "max": "base", "min": "max"}[k] for k in (start, end))
                return _anneal(self.anneal_strategy, points[start], points[end], pct)
            start_step = end_step
        raise AssertionError("unreachable")

    def peak_step(self) -> int:
        """The first optimizer step at (or, when ``pct_start * total_steps`` is not a whole
        number, nearest after) the peak: the end of the first phase."""
        return max(math.ceil(self.pct_start * self.total_steps - 1), 0)

    def value(self, step: int, peak: float) -> float:
        initial = peak / self.div_factor
        points = {"initial": initial, "max": peak, "min": initial / self.final_div_factor}
        return self._interp(step, points, momentum=False)

    def momentum(self, step: int) -> float:
        """beta1 (or SGD momentum) at ``step``, as OneCycleLR with ``cycle_momentum=True``."""
        return self._interp(step, {"base": self.base_momentum, "max": self.max_momentum}, momentum=True)

    def floor(self, peak: float) -> float:
        """Final value, ``peak / div_factor / final_div_factor``."""
        return peak / self.div_factor / self.final_div_factor


@dataclass(frozen=True)
class Cosine:
    """Linear warm-up over ``warmup_steps`` (``peak * (t + 1) / warmup_steps``), then half-cosine down to
    ``peak * min_ratio`` at ``total_steps`` (the nanoGPT / torchtitan schedule)."""

    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.1

    def value(self, step: int, peak: float) -> float:
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        pct = min((step - self.warmup_steps) / decay_steps, 1.0)
        return _anneal("cos", peak, peak * self.min_ratio, pct)

    def momentum(self, step: int) -> float:
        raise ValueError("cycle_momentum needs the onecycle schedule")

    def floor(self, peak: float) -> float:
        return peak * self.min_ratio

    def peak_step(self) -> int:
        """The first optimizer step at the peak: the warm-up's last."""
        return max(self.warmup_steps - 1, 0)


@dataclass(frozen=True)
class Constant:
    """``peak`` at every step (optionally after a linear warm-up)."""

    total_steps: int
    warmup_steps: int = 0

    def value(self, step: int, peak: float) -> float:
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        return peak

    def momentum(self, step: int) -> float:
        raise ValueError("cycle_momentum needs the onecycle schedule")

    def floor(self, peak: float) -> float:
        """Final value: ``peak``. A constant schedule does not decay (the ``"paper"``
        controller's derived gamma is 0); how low auto-LR may take it is
        ``autolr.lr_lower_bound`` (``peak / auto.max_factor``)."""
        return peak

    def peak_step(self) -> int:
        """The first optimizer step at the peak: the warm-up's last."""
        return max(self.warmup_steps - 1, 0)


Schedule = OneCycle | Cosine | Constant


def summary(schedule: Schedule, peak: float) -> str:
    """One line for ``hdet-dryrun``: the shared LR of the first optimizer step, at its
    peak and of the last, in the optimizer's units, for a parameter group whose peak is
    ``peak``.

    Steps are numbered from 1, as ``hdet-train``'s metrics.jsonl and the sync steps are:
    the record ``"step": s`` holds the LR the s-th optimizer step used, which is
    ``schedule.value(s - 1, peak)`` (``value`` takes the 0-based index torch's
    schedulers count, so the last step, ``total_steps``, is ``value(total_steps - 1)``)."""
    name = {OneCycle: "onecycle", Cosine: "cosine", Constant: "constant"}[type(schedule)]
    last = schedule.total_steps - 1  # 0-based index of the last step
    top = min(schedule.peak_step(), last)
    return (f"schedule {name} over {schedule.total_steps} optimizer steps: LR {schedule.value(0, peak):.4g} at step "
            f"1 (the first), peak {schedule.value(top, peak):.4g} at step {top + 1}, {schedule.value(last, peak):.4g} "
            f"at the last step ({last + 1})")
