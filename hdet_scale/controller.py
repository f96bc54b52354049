"""Auto-LR: the zero-order hypergradient meta-update (paper Sec. 3.3, Alg. 1).

Pure functions on Python floats / CPU float64 tensors, no collectives: every rank feeds
them the same all-reduced losses and so computes the same new values. At sync k::

    L_r   = fitness of replica r (probe loss, or mean training loss over the interval)
    s_r   = (mean(L) - L_r) / sigma            (better replica -> larger score)
    w     = softmax(s)

The paper's update ("paper") moves the base value itself::

    Delta = sum_r w_r h_r - mean_r h_r          (zero-order estimate of -dL/dh)
    v     <- beta v + (1 - beta) Delta
    h     <- h (1 - gamma) + lambda v

The log-space update ("log", hdet_scale's default) moves a multiplier ``m`` of the
user's schedule, with a scale-free hypergradient ``g = Delta / (alpha * mean(h))``: the
softmax-weighted mean of the replicas' spread offsets, in ``[-1, 1]`` (+1: all weight on
the largest value)::

    v     <- beta v + (1 - beta) g
    log m <- clip(log m + step_size * v, -log(max_factor), log(max_factor))

``sigma`` is a fixed temperature in nats, or automatic (:func:`auto_temperature`): the
replicas' fitness standard deviation (z-scores, independent of the loss scale) combined
with ``c`` times the measurement noise of the fitness gaps when the probe gives
per-example losses (:func:`fitness_noise`): a gap inside the noise then moves the
multiplier by little, where z-scores alone make every sync a full step (with R = 2 they
are always +-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hdet_scale.errors import HDETConfigError


@dataclass(frozen=True)
class Weights:
    """Softmax weights over replicas (length R, sum 1 over the finite replicas) and
    which replicas had a finite interval loss."""

    weights: list[float]
    finite: list[bool]


def auto_temperature(losses: list[float], noise: float | None = None, noise_scale: float = 0.0) -> float:
    """``sqrt(std(L)^2 + (noise_scale * noise)^2)``: the population standard deviation of
    the finite losses (0.0 with fewer than two; alone, the temperature that turns scores
    into z-scores), widened by the fitness noise (:func:`fitness_noise`, nats; ``None``:
    not measured)."""
    kept = [x for x in losses if math.isfinite(x)]
    spread = float(torch.tensor(kept, dtype=torch.float64).std(unbiased=False)) if len(kept) >= 2 else 0.0
    if noise is None or not math.isfinite(noise) or noise_scale == 0:
        return spread
    return math.hypot(spread, noise_scale * noise)


def fitness_noise(per_example: torch.Tensor) -> float | None:
    """The standard error of a replica's fitness gap to the replicas' mean, from the
    probe's per-example losses ``per_example`` (shape ``(R, N)``: replica r's loss on
    example i, the same N examples for every replica; nats).

    Each replica's gap on example i, ``e_ri = l_ri - mean_r' l_r'i``, is paired: the
    examples' own difficulty cancels, what is left is how much the replicas' ranking
    would change on other examples. Returns ``sqrt(mean_r var_i(e_ri) / N)`` over the
    replicas whose losses are all finite, or ``None`` with fewer than two such replicas
    or fewer than two examples.
    """
    x = per_example.to(torch.float64)
    x = x[torch.isfinite(x).all(dim=1)]
    if x.dim() != 2 or x.shape[0] < 2 or x.shape[1] < 2:
        return None
    e = x - x.mean(dim=0, keepdim=True)
    return float((e.var(dim=1, unbiased=True).mean() / x.shape[1]).sqrt())


def softmax_weights(losses: list[float], temperature: float) -> Weights:
    """``w = softmax((mean(L) - L) / sigma)`` over the replicas with a finite loss.

    A replica whose loss is NaN or +-inf gets weight 0 and never enters the mean, so it
    cannot turn the others' weights into NaN. If no replica is finite, all weights are 0.

    Args:
        losses: interval loss per replica (length R), nats.
        temperature: sigma >= 0, in loss units. 0 (equal losses under an automatic
            temperature) gives equal weights.
    """
    finite = [math.isfinite(x) for x in losses]
    if not any(finite):
        return Weights([0.0] * len(losses), finite)
    kept = torch.tensor([x for x, ok in zip(losses, finite) if ok], dtype=torch.float64)
    if temperature <= 0:
        n = len(kept)
        return Weights([1.0 / n if ok else 0.0 for ok in finite], finite)
    scores = (kept.mean() - kept) / temperature
    w = torch.softmax(scores, dim=0).tolist()
    it = iter(w)
    return Weights([next(it) if ok else 0.0 for ok in finite], finite)


def hypergradient(weights: Weights, values: list[float]) -> float:
    """``Delta = sum_r w_r h_r - mean_r h_r`` (mean over all R replicas).

    Positive when the replicas with larger values did better. A non-finite replica keeps
    its place in the mean: if the high-LR replica diverged, Delta points down. With no
    finite replica, Delta is 0 (the base value is left to the decay alone).
    """
    if not any(weights.finite):
        return 0.0
    return sum(w * h for w, h in zip(weights.weights, values)) - sum(values) / len(values)


def meta_update(base: float, velocity: float, delta: float, momentum: float, step_size: float,
                decay: float) -> tuple[float, float]:
    """One meta-step: returns ``(new_base, new_velocity)``.

    ``v' = beta v + (1 - beta) Delta``; ``h' = h (1 - gamma) + lambda v'``.
    """
    velocity = momentum * velocity + (1.0 - momentum) * delta
    return base * (1.0 - decay) + step_size * velocity, velocity


def derive_decay(start: float, floor: float, num_syncs: int, key: str = "hdet.auto.decay") -> float:
    """gamma with ``(1 - gamma) ** K == floor / start``: the decay alone brings the base
    value from ``start`` (at the first meta-update) to the schedule's ``floor`` after the
    ``K`` remaining syncs.

    The paper's published ``gamma = 1 - exp(-ln(f_div / f_final) / K)`` is negative for
    torch's OneCycle defaults (div 25, final_div 1e4) and would grow the LR; this is the
    intended decay (HDET.md, auto-LR step 5).

    Raises:
        HDETConfigError: gamma outside [0, 1) (floor <= 0, floor > start, K < 1).
    """
    if num_syncs < 1:
        raise HDETConfigError(f"{key}: no sync is left after auto-LR warm-up (K = {num_syncs}); "
                              "shorten hdet.auto.warmup_steps or hdet.sync_interval")
    if not (floor > 0 and start > 0):
        raise HDETConfigError(f"{key}: derived gamma = 1 - (floor/start)^(1/K) is outside [0, 1) because the "
                              f"schedule floor is {floor} and the start value {start}; give a schedule with "
                              "a floor > 0 (e.g. schedule.min_ratio > 0) or set hdet.auto.decay in [0, 1)")
    gamma = 1.0 - (floor / start) ** (1.0 / num_syncs)
    if not 0 <= gamma < 1:
        raise HDETConfigError(f"{key}: derived gamma = {gamma:.6g} is outside [0, 1) (floor {floor:.6g} above "
                              f"start {start:.6g}); set hdet.auto.decay in [0, 1) explicitly")
    return gamma


def normalized_hypergradient(weights: Weights, offsets: list[float]) -> float:
    """``g = sum_r w_r off_r - mean_r off_r`` with ``off_r`` replica r's spread offset in
    ``[-1, 1]`` (``axes.spread_offsets`` under the permutation): ``Delta / (alpha h)``
    for a multiplicative axis. In ``[-1, 1]``; 0 when no replica is finite."""
    if not any(weights.finite):
        return 0.0
    return sum(w * o for w, o in zip(weights.weights, offsets)) - sum(offsets) / len(offsets)


def log_update(log_m: float, velocity: float, g: float, momentum: float, step_size: float,
               max_factor: float) -> tuple[float, float]:
    """One log-space meta-step: returns ``(new_log_m, new_velocity)``.

    ``v' = beta v + (1 - beta) g``; ``log m' = clip(log m + step_size v', +-log(max_factor))``.
    """
    velocity = momentum * velocity + (1.0 - momentum) * g
    bound = math.log(max_factor)
    return min(max(log_m + step_size * velocity, -bound), bound), velocity
