"""Model-side axes: the setters that put a replica's dropout and attention temperature
into the module it runs (:meth:`hdet_scale.ensemble.HDETScheduler.bind_model`).

What each axis sets, in every module of the model whose name matches
``hdet.axes.<axis>.modules`` (fnmatch patterns, names as ``model.named_modules()`` gives
them inside any DeepSpeed / DDP wrapper; ``None``: every module):

* ``dropout``: the probability ``p`` of every ``nn.Dropout`` (any ``_DropoutNd``), the
  ``attention_dropout`` of Hugging Face attention modules (``LlamaAttention`` and the
  like: a float they pass to the attention kernel while training), and any module's
  ``hdet_set_dropout(p)`` method (the hook for a model of one's own).
* ``temperature`` ``tau``: Hugging Face attention modules scale their logits by
  ``scaling`` (``head_dim ** -0.5``); it becomes ``scaling_0 / tau`` (``tau > 1``
  flattens the softmax), ``scaling_0`` being the module's value when first bound. Any
  module's ``hdet_set_temperature(tau)`` method is called instead where it exists.
* ``label_smoothing`` sets nothing here: the loss reads
  :meth:`~hdet_scale.ensemble.HDETScheduler.model_value` (``hdet-train`` does).

The setters change Python attributes only: they work on a model that ZeRO-3 partitions
or FSDP2 shards, and cost nothing per step. Every rank of a replica binds its own copy
of the same module tree and sets the same value, so the whole replica runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

from torch import nn

from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError

Setter = Callable[[float], None]


def _root(model: Any) -> nn.Module:
    """The user's module inside DeepSpeed's engine or DDP (both keep it as ``.module``)."""
    for _ in range(4):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _modules(root: nn.Module, patterns: list[str] | None) -> list[nn.Module]:
    return [m for name, m in root.named_modules() if patterns is None or any(fnmatch(name, p) for p in patterns)]


def _dropout_targets(modules: list[nn.Module]) -> list[Setter]:
    out: list[Setter] = []
    for m in modules:
        if callable(getattr(m, "hdet_set_dropout", None)):
            out.append(m.hdet_set_dropout)
        elif isinstance(m, nn.modules.dropout._DropoutNd):
            out.append(lambda v, m=m: setattr(m, "p", float(v)))
        elif isinstance(getattr(m, "attention_dropout", None), float):
            out.append(lambda v, m=m: setattr(m, "attention_dropout", float(v)))
    return out


def _temperature_targets(modules: list[nn.Module]) -> list[Setter]:
    out: list[Setter] = []
    for m in modules:
        if callable(getattr(m, "hdet_set_temperature", None)):
            out.append(m.hdet_set_temperature)
        elif isinstance(getattr(m, "scaling", None), float) and hasattr(m, "head_dim"):
            if not hasattr(m, "_hdet_scaling"):  # the module's own scale, kept across binds
                m._hdet_scaling = m.scaling

            def set_tau(tau: float, m: nn.Module = m) -> None:
                m.scaling = m._hdet_scaling / float(tau)

            out.append(set_tau)
    return out


_TARGETS = {"dropout": (_dropout_targets, "an nn.Dropout, an attention module with attention_dropout, or a module "
                                          "with hdet_set_dropout(p)"),
            "temperature": (_temperature_targets, "an attention module with scaling and head_dim (Hugging Face), "
                                                  "or a module with hdet_set_temperature(tau)")}


def setters(model: Any, cfg: HDETConfig) -> dict[str, Setter]:
    """``{axis: set(value)}`` for the model-side axes of ``cfg`` that set modules of
    ``model`` (each setter sets every matching module).

    Raises:
        HDETConfigError: an axis finds no module to set, naming what it looks for.
    """
    root = _root(model)
    out: dict[str, Setter] = {}
    for axis, (find, wanted) in _TARGETS.items():
        spec = cfg.axes.get(axis)
        if spec is None:
            continue
        matched = _modules(root, spec.modules)
        if spec.modules and not matched:  # not "among the modules matching" nothing
            names = [n for n, _ in root.named_modules() if n][:3]
            prefix = (" (names carry no 'module.' prefix)" if any(p.startswith("module.") for p in spec.modules)
                      else "")
            raise HDETConfigError(f"hdet.axes.{axis}.modules: {spec.modules} match no module name of "
                                  f"{type(root).__name__}{prefix}; its names look like {', '.join(names)}, ...")
        targets = find(matched)
        if not targets:
            where = f" among the modules matching {spec.modules}" if spec.modules else ""
            raise HDETConfigError(f"hdet.axes.{axis}: nothing to set in {type(root).__name__}{where}: it needs "
                                  f"{wanted}")
        # each pattern must find something: a typo beside a good pattern would go unseen
        idle = [p for p in spec.modules or [] if not find(_modules(root, [p]))]
        if idle:
            raise HDETConfigError(f"hdet.axes.{axis}.modules: {idle[0]!r} matches no module it can set in "
                                  f"{type(root).__name__} (it needs {wanted})")

        def set_all(value: float, targets: list[Setter] = targets) -> None:
            for t in targets:
                t(value)

        out[axis] = set_all
    return out
