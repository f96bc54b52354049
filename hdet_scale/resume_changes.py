"""What a resume changes in the ``hdet`` block (so that ``HDETTrainer`` never resumes a
checkpoint with another ``axes.lr.spread_ratio`` without a word; ``hdet-train`` lists its
changes from its own run config, ``train/resume_config.py``).

:meth:`HDETScheduler.state_dict <hdet_scale.ensemble.HDETScheduler.state_dict>` keeps the
block it ran with (``HDETConfig.to_dict()``); its ``load_state_dict`` compares it with the
current one and warns (:class:`~hdet_scale.errors.HDETResumeWarning`) once per load.
"""

from __future__ import annotations

from typing import Any

# What a resume cannot change is refused before (ensemble.load_state_dict); logging is not
# training (where the metrics go), and what hdet-train fills from its own config is its
# notice's.
_NOT_COMPARED = ("logging", "replicas", "sync_interval")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: leaf}`` of a nested dict (an empty dict is a leaf)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _effect(key: str) -> str:
    if key == "seed":
        return "the checkpoint's permutation generator is kept"
    if key.startswith("warm_init."):
        return "no effect on a resumed run"
    return "this run's value applies from here on"


def config_changes(saved: Any, now: dict) -> list[str]:
    """``"hdet.<key>: old -> new (effect)"`` for each key of the block that differs between
    the checkpoint's ``saved`` block (``None`` for a checkpoint written before it was
    kept: nothing to say) and ``now``; a key present on one side only counts too."""
    if not isinstance(saved, dict):
        return []
    old = {k: v for k, v in flatten(saved).items() if k.split(".")[0] not in _NOT_COMPARED}
    new = {k: v for k, v in flatten(now).items() if k.split(".")[0] not in _NOT_COMPARED}
    missing = "(not set)"
    return [f"hdet.{k}: {old.get(k, missing)!r} -> {new.get(k, missing)!r} ({_effect(k)})"
            for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)]


def peak_changes(saved: Any, now: list[float]) -> list[str]:
    """``"peak LR of group <g>: old -> new (...)"`` for each parameter group whose peak LR
    (the optimizer's ``lr``, or ``hdet.schedule.max_lr``) differs from the checkpoint's
    ``saved`` list (``None``: saved before it was kept). Without it a library resume
    with another ``lr`` would train on with it without a word, where ``hdet-train``
    lists it."""
    if not isinstance(saved, list) or len(saved) != len(now):
        return []
    return [f"peak LR of group {g}: {old!r} -> {new!r} (this run's value applies from here on)"
            for g, (old, new) in enumerate(zip(saved, now)) if old != new]
