"""Errors raised by hdet_scale."""


class HDETConfigError(ValueError):
    """A configuration value is invalid.

    The message names the dotted key (for example ``hdet.axes.lr.spread``) and the
    allowed values. Raised before any collective, identically on every rank, so a bad
    config never leaves a rank waiting in a collective.
    """


class HDETStateError(RuntimeError):
    """HDET state that cannot go on: a checkpoint that cannot be resumed with the current
    layout or configuration, or ranks at different steps (:class:`HDETStepMismatchError`)."""


class HDETUntrustedFileError(HDETStateError):
    """A checkpoint file that names code to run on load (a callable or a type outside the
    data a checkpoint holds): refused before anything is loaded, on every rank, naming
    the file and the reference (``backends/safe_load.py``)."""


class HDETStepMismatchError(HDETStateError):
    """Ranks reached a sync at different HDET steps (``scheduler.step_count``).

    Found by the interval-loss all-reduce every sync runs (no extra collective). Every
    rank sees the same reduced values, so every rank raises it at the same sync and none
    is left waiting in a collective. The message names each step and the ranks at it.
    """


class HDETResumeWarning(UserWarning):
    """A checkpoint resumed with other ``hdet`` settings than it was written with (those
    that can change; the others raise :class:`HDETStateError`). The message lists each
    changed key ``old -> new``. ``hdet-train`` filters it: its own resume notice lists
    every changed setting of the whole run config."""
