"""What DeepSpeed's own tools (``zero_to_fp32.py``) need in every replica's checkpoint
folder, where DeepSpeed writes it for global rank 0's folder only.

Tied parameters. DeepSpeed records which parameter names share one tensor (a tied input embedding and LM
head: ``{"lm_head.weight": "model.embed_tokens.weight"}``) as ``shared_params`` in each
``*_model_states.pt``; ``zero_to_fp32.py`` puts the tied names back from it. Its engine
fills that map on global rank 0 only (``DeepSpeedEngine._get_shared_params``: ``if
dist.get_rank() == 0``) and leaves it empty elsewhere: with one DeepSpeed job per world
that is the one file the tool reads, but HDET writes a DeepSpeed checkpoint per replica,
and the first shard rank of replica r > 0 is not global rank 0. ``zero_to_fp32.py`` on
``replica_1`` would then drop ``lm_head.weight``.

The tag and the script. DeepSpeed's tools read ``latest`` in the folder they are given,
and DeepSpeed copies ``zero_to_fp32.py`` into global rank 0's folder only:
:func:`link_tool_files` links both into every replica's folder.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hdet_scale.backends.checkpoint_io import LATEST_FILE


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


def link_tool_files(save_dir: str, replicas: int) -> None:
    """``replica_<r>/latest`` as a link to ``../latest`` in each replica folder, so that
    DeepSpeed's own tools, which read ``latest`` in the folder they are given
    (``zero_to_fp32.py``, copied into ``replica_0``), find the tag (not "Unable to find
    'latest' file"); and ``replica_<r>/zero_to_fp32.py`` and ``zero_to_torch.py``
    for r > 0 as links to replica 0's copies, so each folder holds what DeepSpeed
    documents. Links, not copies:
    ``latest`` always names what the one ``latest`` names, which moves only when every
    replica's save is complete. A filesystem without links: skipped (the tools then take
    ``--tag``)."""
    for r in range(replicas):
        links = {LATEST_FILE: os.path.join(os.pardir, LATEST_FILE)}
        if r > 0:  # DeepSpeed copies its recovery scripts on global rank 0 only
            links.update({script: os.path.join(os.pardir, "replica_0", script) for script in _RECOVERY_SCRIPTS})
        for name, target in links.items():
            link = os.path.join(save_dir, f"replica_{r}", name)
            if os.path.lexists(link) or not os.path.exists(os.path.join(os.path.dirname(link), target)):
                continue
            try:
                os.symlink(target, link)
            except OSError:
                return


#: What ``DeepSpeedEngine._copy_recovery_script`` copies into the save folder (a version
#: without ``zero_to_torch.py`` leaves no source: no link is made then).
_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
