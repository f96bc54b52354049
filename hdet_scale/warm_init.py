"""Warm noisy initialisation (paper Sec. "Warm Noisy Initialization"): the arithmetic.

Before the first fan-out each replica adds independent Gaussian noise to the weights it
starts from (the current weights, or a checkpoint loaded into the model)::

    theta_r <- theta + N(0, nu^2 * ||theta||^2 / d)

Norm convention: the paper's text, ``||theta||`` over the *whole model* (every floating
parameter) and ``d`` its parameter count, so the noise std is ``nu * RMS(theta)`` for
every tensor. One sum of squares per rank and one all-reduce over the shard group give
it on every backend, flat ZeRO-3 partitions included (the paper's code takes the norm
per tensor, which flat partitions do not map to without gathering).

Pure helpers; the communication is the sync's (``DistributedSync.add_noise``,
``SimulatedSync.add_noise``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def noise_seed(seed: int, replica: int, shard: int) -> int:
    """splitmix64 of ``(seed, replica, shard)``: the seed of one rank's noise generator.
    Different replicas draw independent noise; the ``S`` ranks of a replica that shard
    the model draw their own parts of it (``shard`` = shard index), ranks that hold full
    copies pass ``shard = 0`` and so draw the same noise."""
    mask = (1 << 64) - 1
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(replica) * 0xD1B54A32D192ED03 + int(shard) * 0xABC98388FB8FAC03
         + 0x632BE59BD9B4E019) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> tuple[float, int]:
    """``(sum of squares in float64, element count)`` of ``tensors``."""
    total = sum(float(t.detach().double().pow(2).sum()) for t in tensors)
    return total, sum(t.numel() for t in tensors)


@torch.no_grad()
def add_noise_(tensors: Sequence[torch.Tensor], std: float, generator: torch.Generator) -> None:
    """``t += std * N(0, 1)`` for each tensor in order, drawn on the CPU from
    ``generator`` (so the draws do not depend on the device) and cast to ``t``'s dtype."""
    for t in tensors:
        if t.numel() == 0:
            continue
        noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
        t.add_(noise.to(device=t.device, dtype=t.dtype), alpha=std)
