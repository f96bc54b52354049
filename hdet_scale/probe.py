"""Checks of the auto-LR probe function (``hdet.auto.fitness = "probe"``): its signature
before any collective, its result before it enters one. Pure, no communication."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from hdet_scale.errors import HDETConfigError


def require_probe(cfg: Any, probe: Any, name: str, signature: str | None = None, nargs: int = 0) -> None:
    """The one check of a probe against an ``HDETConfig``, before any collective and on
    every rank alike: auto-LR scoring replicas by probe loss needs one, and a given probe
    must be callable as ``signature`` (``nargs`` positional arguments; not checked when
    ``signature`` is ``None``). A probe given where nothing calls it (``train_loss``
    fitness, auto-LR off) is a ``UserWarning``.

    Raises:
        HDETConfigError: a missing probe (naming ``hdet.auto.fitness``) or a wrong one
            (naming ``name``).
    """
    if cfg.enabled and cfg.uses_probe and probe is None:
        raise HDETConfigError("hdet.auto.fitness: 'probe' (the default) needs probe batches: pass probe=... to a "
                              "backend's initialize, hdet_scale.prepare or HDETTrainer (probe(model) -> this rank's loss on "
                              "its slice of fixed probe batches, the same batches in every replica) or probe_fn=... to "
                              "the Simulator (probe_fn(model, r)), or set hdet.auto.fitness='train_loss'")
    if probe is not None and signature is not None:
        check_callable(probe, name, signature, nargs)
    if cfg.enabled and probe is not None and not cfg.uses_probe:
        # a probe beside auto.fitness 'train_loss' is never called: said, not silent
        if cfg.auto_can_move:
            why = ("hdet.auto.fitness is 'train_loss' (replicas are scored by their training loss); set "
                   f"hdet.auto.fitness='probe' to score replicas with it, or drop {name}")
        else:  # not advising fitness 'probe' where it is 'probe' already
            why = (f"auto-LR scores no replicas in this config (auto-LR off, one replica, or no spread on an axis it "
                   f"controls: see the warnings above); drop {name} or give an axis a spread with auto-LR on")
        warnings.warn(f"{name}: given but never called: {why}", UserWarning, stacklevel=2)


def check_callable(fn: Any, name: str, signature: str, nargs: int) -> None:
    """Raise HDETConfigError unless ``fn`` can be called with ``nargs`` positional
    arguments (checked without calling it, so before any collective)."""
    if not callable(fn):
        raise HDETConfigError(f"{name}: expected a function {signature}, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*([None] * nargs))
    except TypeError as e:
        raise HDETConfigError(f"{name}: must be callable as {signature} ({e})") from None
    except ValueError:  # builtins without a signature: trust them
        pass


def probe_examples(loss: Any) -> torch.Tensor | None:
    """A probe's per-example losses as a 1-D float64 CPU tensor, when it returned a 1-D
    tensor of two or more (one loss per probe sequence, nats: what lets auto-LR measure
    the noise of the fitness gaps, ``controller.fitness_noise``); ``None`` for a number
    or a one-element tensor (its mean alone).

    Raises:
        HDETConfigError: a tensor of more than one dimension, or an empty one.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() == 1:
        return None
    if loss.dim() != 1 or loss.numel() == 0:
        raise HDETConfigError(f"probe: must return this rank's mean probe loss (a number or a one-element tensor) "
                              f"or its per-example losses (a 1-D tensor), got a tensor of shape {tuple(loss.shape)}")
    return loss.detach().to(device="cpu", dtype=torch.float64)


def probe_value(loss: Any) -> float:
    """A probe's result as a float: a Python number or a one-element tensor, or the mean
    of a 1-D tensor of per-example losses (:func:`probe_examples`).

    Raises:
        HDETConfigError: anything else (a list, a string, a batch of losses), naming the
            probe, so the mistake is not reported as a shape error deep in a collective.
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().double().reshape(()))
    examples = probe_examples(loss)
    if examples is not None:
        return float(examples.mean())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:80]
    raise HDETConfigError(f"probe: must return this rank's mean probe loss as a number or a one-element tensor, "
                          f"got {what}")
