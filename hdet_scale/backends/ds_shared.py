"""Tied parameters named in every replica's DeepSpeed checkpoint.

DeepSpeed records which parameter names share one tensor (a tied input embedding and LM
head: ``{"lm_head.weight": "model.embed_tokens.weight"}``) as ``shared_params`` in each
``*_model_states.pt``; ``zero_to_fp32.py`` puts the tied names back from it. Its engine
fills that map on global rank 0 only (``DeepSpeedEngine._get_shared_params``: ``if
dist.get_rank() == 0``) and leaves it empty elsewhere: with one DeepSpeed job per world
that is the one file the tool reads, but HDET writes a DeepSpeed checkpoint per replica,
and the first shard rank of replica r > 0 is not global rank 0. ``zero_to_fp32.py`` on
``replica_1`` then dropped ``lm_head.weight`` (tester round 58).
"""

from __future__ import annotations

from typing import Any

import torch


def shared_param_names(module: torch.nn.Module) -> dict[str, str]:
    """``{name: name of the first parameter holding the same tensor}`` for every later
    name of a shared parameter, in ``named_parameters`` order (DeepSpeed's own order: a
    module's own parameters, then its children's, depth first). Under ZeRO-3 parameters
    are identified by ``ds_id`` (their storage is swapped as they are gathered), else by
    the object. Local: no collective; the same on every rank of one model."""
    first: dict[Any, str] = {}
    shared: dict[str, str] = {}
    zero3 = any(hasattr(p, "ds_id") for p in module.parameters())
    for name, p in module.named_parameters(remove_duplicate=False):
        if zero3 and not hasattr(p, "ds_id"):
            continue  # as DeepSpeed: a parameter ZeRO-3 does not manage is not in its files
        key = p.ds_id if zero3 else id(p)
        if key in first:
            shared[name] = first[key]
        else:
            first[key] = name
    return shared


def name_shared_params_everywhere(engine: Any) -> None:
    """Make ``engine``'s checkpoints record ``shared_params`` on every rank, as global rank
    0's do. Touches this engine object only."""
    engine._get_shared_params = lambda: shared_param_names(engine.module)
