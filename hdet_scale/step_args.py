"""What ``HDETScheduler.step`` accepts, checked before any state change: the step's
training loss, and nothing else."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from hdet_scale.errors import HDETConfigError


def check_loss_args(loss: Any, kwargs: dict[str, Any], many: bool) -> None:
    """Refuse what ``HDETScheduler.step(loss, **kwargs)`` cannot use.

    The loss is ``None`` (nothing recorded), a float (not an int or bool) or a
    one-element floating-point tensor, in nats; with ``many`` (the simulator, which drives
    several replicas) also a sequence of them or a 1-D tensor, one per replica. No keyword
    is accepted: a misspelt ``lr_kwargs`` key would otherwise leave the loss unrecorded
    without a word. Errors are HDETConfigError, never TypeError: DeepSpeed's engine
    catches a TypeError from ``lr_scheduler.step(**lr_kwargs)`` and calls
    ``lr_scheduler.step(train_batch_size)`` instead, which would record the batch size as
    the loss (an int is refused for that reason too).

    Raises:
        HDETConfigError: a keyword argument, or a loss of another type, naming it.
    """
    if kwargs:
        raise HDETConfigError(f"HDETScheduler.step: unexpected argument(s) {sorted(kwargs)}; it takes the step's "
                              "training loss only: engine.step(lr_kwargs={'loss': loss}) or scheduler.step(loss)")
    if loss is None:
        return
    values = list(loss) if many and isinstance(loss, (list, tuple)) else [loss]
    for x in values:
        if isinstance(x, torch.Tensor):
            ok = x.is_floating_point() and (x.numel() == 1 or (many and x.dim() == 1))
        else:
            ok = isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral)
        if not ok:
            hint = (" (an int is what DeepSpeed passes, its train_batch_size, after lr_scheduler.step(**lr_kwargs) "
                    "raised a TypeError: the error above this one says why)"
                    if isinstance(x, numbers.Integral) and not isinstance(x, bool) else "")
            what = (f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}" if isinstance(x, torch.Tensor)
                    else f"{type(x).__name__} {x!r}")
            raise HDETConfigError("HDETScheduler.step: the loss must be a float or a one-element floating-point "
                                  f"tensor (the step's training loss, nats), got {what}{hint}")
