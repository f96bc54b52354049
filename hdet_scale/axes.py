"""Fan-out: the values each replica uses for an explored hyperparameter.

Pure functions (HDET.md "Fan-out"; paper Eq. 1). For R replicas and spread ratio alpha::

    delta  = max((R - 1) / 2, 0.5)
    off_j  = (j - (R - 1) / 2) / delta        j = 0 .. R-1, symmetric, in [-1, 1]
    rho_j  = 1 + alpha * off_j                (multiplicative axis)
    h_r    = h * rho_{pi(r)}   or   h + alpha * off_{pi(r)}   (additive axis)

``pi`` is a permutation of ``0 .. R-1`` drawn from a dedicated ``torch.Generator``, so
every rank that holds the same generator state draws the same permutation and the
global RNG (model init, dropout, data order) is never touched.
"""

from __future__ import annotations

import torch


def spread_offsets(replicas: int) -> list[float]:
    """Symmetric offsets ``off_j`` in ``[-1, 1]`` with mean exactly 0 (length R)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    center = (replicas - 1) / 2
    delta = max(center, 0.5)
    return [(j - center) / delta for j in range(replicas)]


def multipliers(replicas: int, spread_ratio: float) -> list[float]:
    """``rho_j = 1 + alpha * off_j``, in ``[1 - alpha, 1 + alpha]``, mean 1 (paper Eq. 1).

    Raises:
        ValueError: ``spread_ratio`` < 0 or >= 1 (a multiplier would be <= 0).
    """
    if not 0 <= spread_ratio < 1:
        raise ValueError(f"spread_ratio must be in [0, 1) for a multiplicative axis, got {spread_ratio}")
    return [1.0 + spread_ratio * o for o in spread_offsets(replicas)]


def draw_permutation(generator: torch.Generator, replicas: int) -> list[int]:
    """A uniformly random permutation of ``0 .. R-1`` from ``generator`` (CPU)."""
    return torch.randperm(replicas, generator=generator).tolist()


def replica_value(base: float, kind: str, spread_ratio: float, slot: int, replicas: int) -> float:
    """Value of one replica whose permuted slot is ``slot = pi(r)``."""
    offset = spread_offsets(replicas)[slot]
    if kind == "multiplicative":
        return base * (1.0 + spread_ratio * offset)
    return base + spread_ratio * offset


def replica_values(base: float, kind: str, spread_ratio: float, permutation: list[int]) -> list[float]:
    """Values of all R replicas (index r) under ``permutation``; their mean is ``base``
    (up to float rounding), since the offsets are symmetric."""
    replicas = len(permutation)
    return [replica_value(base, kind, spread_ratio, permutation[r], replicas) for r in range(replicas)]
