"""Errors raised by hdet_scale."""


class HDETConfigError(ValueError):
    """A configuration value is invalid.

    The message names the dotted key (for example ``hdet.axes.lr.spread``) and the
    allowed values. Raised before any collective, identically on every rank, so a bad
    config never leaves a rank waiting in a collective.
    """


class HDETStateError(RuntimeError):
    """A checkpoint cannot be resumed with the current layout or configuration."""
