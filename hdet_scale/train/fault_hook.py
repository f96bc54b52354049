"""The fault-injection hook of hdet-train's tests, ``HDET_FAULT_KILL="<rank>:<step>"``:
that global rank kills itself with SIGKILL right after that optimizer step (tests of a
dead rank, a resume, a torchrun restart). Split from ``train/rundir.py``."""

from __future__ import annotations

import os
import signal

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.rundir import _restart_count

FAULT_ENV = "HDET_FAULT_KILL"


def fault_point(world_size: int | None = None, steps: int | None = None) -> tuple[int, int] | None:
    """The fault-injection hook for tests, ``HDET_FAULT_KILL="<rank>:<step>"``: that global
    rank kills itself with SIGKILL right after finishing that optimizer step (before a
    checkpoint due at that step). Only in a first attempt: a torchrun restart
    (``TORCHELASTIC_RESTART_COUNT`` > 0) ignores it, so the restarted job can finish.
    Given ``world_size`` and ``steps`` (``train.steps``), a kill that could never happen
    is refused rather than silently never fired.

    Raises:
        HDETConfigError: the variable is set but not two integers ``rank:step``, or
            (when given) the rank is not in ``[0, world_size)`` or the step not in
            ``[1, steps]``; the message names the variable and the valid ranges.
    """
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or _restart_count() > 0:
        return None
    ranges = (f"rank in [0, {world_size - 1}] (world size {world_size}), step in [1, {steps}] (train.steps)"
              if world_size is not None and steps is not None else "")
    try:
        rank, step = (int(x) for x in spec.split(":"))
    except ValueError:
        raise HDETConfigError(f"{FAULT_ENV}: expected '<rank>:<step>' (test hook{': ' + ranges if ranges else ''}), "
                              f"got {spec!r}") from None
    if ranges and not (0 <= rank < world_size and 1 <= step <= steps):
        raise HDETConfigError(f"{FAULT_ENV}={spec!r} would never fire: expected '<rank>:<step>' with {ranges}")
    return rank, step


def maybe_kill(fault: tuple[int, int] | None, rank: int, step: int) -> None:
    if fault is not None and fault == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
