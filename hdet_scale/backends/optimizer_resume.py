"""What a resume keeps of the optimizer's settings (a library run loaded with other
``betas`` or ``weight_decay`` than its checkpoint trains on with the checkpoint's, bit
for bit, which would otherwise go without a word; ``hdet-train`` warns of it from its own config,
``train/resume_config.py``).

torch's ``Optimizer.load_state_dict`` (and DCP's ``set_optimizer_state_dict``, fairscale's
OSS, DeepSpeed's ZeRO optimizers) restores every parameter group's settings with the
state. HDET then sets the values it drives (the LR and the explored axes) from this
run's config, so a change of those applies; any other change is lost. The backends'
``load_checkpoint`` take :func:`group_settings` before the load and call
:func:`warn_kept_settings` after it.
"""

from __future__ import annotations

import warnings
from typing import Any

from hdet_scale import iterates
from hdet_scale.errors import HDETResumeWarning

# HDET's schedule sets the LR every step (initial_lr: torch schedulers'); DeepSpeed's CPU
# Adam counts its steps in each group ("step"): state, not a setting
_NOT_SETTINGS = ("lr", "initial_lr", "step")


def _plain(value: Any) -> Any:
    """A comparable form: tuples and lists alike (DCP may return a tuple as a list),
    one-element tensors as floats."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "numel") and hasattr(value, "item"):
        return value.item() if value.numel() == 1 else repr(value)
    return value


def group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter group's settings (all keys but ``params``), comparable form."""
    return [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def kept_settings(before: list[dict[str, Any]], optimizer: Any, axes: Any) -> list[str]:
    """``"group <g> <key>: <this run's> -> <the checkpoint's> (kept)"`` for each setting
    the load replaced and HDET does not set again: not the LR, not an explored axis
    (``axes``: the names in ``hdet.axes``; ``beta2`` leaves ``betas[0]`` compared)."""
    after = group_settings(optimizer)
    # ZeRO's optimizer shows its client optimizer's groups: the client's spec
    spec = iterates.spec_for(getattr(optimizer, "optimizer", optimizer))
    skip = set(_NOT_SETTINGS) | {a for a in axes if a != "beta2"} | set(spec.group_state if spec else ())
    out = []
    for g, (mine, saved) in enumerate(zip(before, after)):
        for key in sorted(set(mine) | set(saved)):
            if key in skip:
                continue
            a, b = mine.get(key), saved.get(key)
            if key == "betas" and "beta2" in axes and isinstance(a, list) and isinstance(b, list):
                a, b = a[:1], b[:1]
            if a != b:
                out.append(f"group {g} {key}: {mine.get(key)!r} -> {saved.get(key)!r}")
    return out


def warn_kept_settings(before: list[dict[str, Any]], optimizer: Any, axes: Any) -> None:
    """Warn (:class:`HDETResumeWarning`, once per load) of the settings
    :func:`kept_settings` finds, and how to change one."""
    changes = kept_settings(before, optimizer, axes)
    if changes:
        warnings.warn(HDETResumeWarning(
            "optimizer: the checkpoint's parameter-group settings replaced this run's (the load restores them with "
            "the optimizer state; HDET sets only the LR and its axes again):\n  " + "\n  ".join(changes)
            + "\n  to train on with a new value, set optimizer.param_groups[g][key] after load_checkpoint"),
            stacklevel=3)
