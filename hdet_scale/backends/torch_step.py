"""The optimizer step of the torch backends (FSDP2, DDP, fairscale OSS), with the
skipped-step rule every backend follows.

DeepSpeed ZeRO-3 skips the update when the gradient norm is not finite, and the DeepSpeed
backend still counts the step as an HDET step. With the torch backends the user's loop
owns the optimizer step; :func:`optimizer_step` does the same there (``hdet-train`` calls
it), so every rank stays at the same HDET step whatever the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["optimizer_step"]


def optimizer_step(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: Any,
                   loss: Any, clip: float = 0.0) -> bool:
    """Clip, step the optimizer, zero the grads, then ``scheduler.step(loss)``; when the
    gradient norm is not finite, skip the update (grads zeroed) and still call
    ``scheduler.step(loss)``: the step counts as an HDET step, as on DeepSpeed
    (docs/backends.md "Skipped steps and step agreement"). Its loss is recorded as on
    any step; a non-finite one makes the replica's interval loss non-finite (softmax
    weight 0, left out of converge).

    Call it after the backward passes (and the engine's gradient all-reduce) of one
    optimizer step. The norm is the same on every rank of a replica, so the whole replica
    decides alike: DDP and fairscale grads are all-reduced inside the DDP group before
    this runs; FSDP2's norm over DTensor shards is reduced over their mesh
    (``full_tensor``). The norm is taken even with clipping off: one host sync per step.

    Args:
        parameters: the model's parameters (``model.parameters()``; DTensors under FSDP2).
        optimizer: the backend's optimizer.
        scheduler: the :class:`~hdet_scale.ensemble.HDETScheduler`.
        loss: the step's loss on this rank (0-dim tensor or float, nats), or ``None``.
        clip: max L2 norm of the gradient (``gradient_clipping``); 0 = no clipping.

    Returns:
        Whether the update was applied.

    Raises:
        ValueError: a step past ``schedule.total_steps`` (``HDETScheduler.check_can_step``),
            before the optimizer steps.
    """
    from torch.distributed.tensor import DTensor

    if hasattr(scheduler, "check_can_step"):  # a step past total_steps: refused before any weight moves
        scheduler.check_can_step()
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    total = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if not torch.isfinite(total):
        optimizer.zero_grad(set_to_none=True)
        scheduler.step(loss)
        return False
    if clip > 0:
        # What clip_grad_norm_ does after computing the same norm.
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step(loss)
    return True
