"""hdet_scale: Hyperparameter-Divergent Ensemble Training (HDET, arXiv 2604.24708) for
DeepSpeed ZeRO-3, PyTorch FSDP2, DDP and fairscale OSS.

Public API: :func:`prepare` (one API on every engine: an :class:`Ensemble`),
:func:`initialize` (``deepspeed.initialize`` with HDET),
:func:`build_topology` and :func:`zero_init` (the layout first, then the model built
partitioned over its shard groups),
:func:`save_checkpoint` / :func:`load_checkpoint` (DeepSpeed), the other engines'
``initialize`` / ``save_checkpoint`` / ``load_checkpoint`` in ``hdet_scale.backends.fsdp2``,
``.ddp`` and ``.fairscale``, :class:`OneCycleAutoLR` (the paper's drop-in scheduler on
DDP), :class:`HDETScheduler`, :class:`HDETConfig`, :class:`Simulator` (R replicas in one
process), :func:`teardown` (end a job's distributed state so that another can start in
the same process). DeepSpeed and fairscale are imported only by their backends.
"""

from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError, HDETStateError, HDETStepMismatchError, HDETUntrustedFileError

__version__ = "0.1.0"

# Imported on first use (PEP 562): they import torch (~1 s), which the CLIs' config checks
# never need, so a mistyped key is refused before torch is loaded.
_LAZY = {"Ensemble": "hdet_scale.api", "HDETScheduler": "hdet_scale.ensemble", "OneCycleAutoLR": "hdet_scale.reference",
         "SimulatedSync": "hdet_scale.simulate", "Simulator": "hdet_scale.simulate", "teardown": "hdet_scale.reset"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hdet_scale' has no attribute {name!r}")


def prepare(*args, **kwargs):
    """See :func:`hdet_scale.api.prepare`: one API on DeepSpeed, FSDP2, DDP and fairscale."""
    from hdet_scale.api import prepare as _prepare

    return _prepare(*args, **kwargs)


def initialize(*args, **kwargs):
    """See :func:`hdet_scale.backends.deepspeed.initialize`."""
    from hdet_scale.backends.deepspeed import initialize as _initialize

    return _initialize(*args, **kwargs)


def build_topology(*args, **kwargs):
    """See :func:`hdet_scale.backends.deepspeed.build_topology`."""
    from hdet_scale.backends.deepspeed import build_topology as _build

    return _build(*args, **kwargs)


def zero_init(*args, **kwargs):
    """See :func:`hdet_scale.backends.deepspeed.zero_init`."""
    from hdet_scale.backends.deepspeed import zero_init as _zero_init

    return _zero_init(*args, **kwargs)


def save_checkpoint(*args, **kwargs):
    """See :func:`hdet_scale.backends.deepspeed.save_checkpoint`."""
    from hdet_scale.backends.deepspeed import save_checkpoint as _save

    return _save(*args, **kwargs)


def load_checkpoint(*args, **kwargs):
    """See :func:`hdet_scale.backends.deepspeed.load_checkpoint`."""
    from hdet_scale.backends.deepspeed import load_checkpoint as _load

    return _load(*args, **kwargs)


__all__ = ["Ensemble", "HDETConfig", "HDETConfigError", "HDETScheduler", "HDETStateError", "HDETStepMismatchError", "HDETUntrustedFileError", "OneCycleAutoLR", "SimulatedSync", "Simulator",
           "build_topology", "initialize", "load_checkpoint", "prepare", "save_checkpoint", "teardown", "zero_init"]
