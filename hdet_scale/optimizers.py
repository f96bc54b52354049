"""The optimizers hdet_scale builds from a DeepSpeed-style ``optimizer`` block, by their
``optimizer.type`` names: torch's AdamW, Adam and SGD on the non-DeepSpeed engines, and
schedule-free AdamW (optional: the ``schedulefree`` package) on every engine, DeepSpeed
included, which does not know it (:data:`CLIENT_BUILT`). Pure: no collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from hdet_scale.errors import HDETConfigError

OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
try:  # optional ([schedulefree] extra): HDET averages its z with the weights (hdet_scale.iterates)
    from schedulefree import AdamWScheduleFree
except ImportError:
    AdamWScheduleFree = None
else:
    OPTIMIZERS["AdamWScheduleFree"] = AdamWScheduleFree

#: ``optimizer.type`` names that DeepSpeed does not know and that hdet_scale builds itself
#: and hands DeepSpeed as a client optimizer (``backends.deepspeed.initialize``).
CLIENT_BUILT = ("AdamWScheduleFree",)


def client_built(ds: dict) -> str | None:
    """The :data:`CLIENT_BUILT` name of the config's ``optimizer.type`` (any case), or
    ``None`` when DeepSpeed builds it (or there is no optimizer block)."""
    opt = ds.get("optimizer")
    kind = opt.get("type") if isinstance(opt, dict) else None
    if isinstance(kind, str):
        for name in CLIENT_BUILT:
            if name.lower() == kind.lower():
                return name
    return None


def build_client_optimizer(name: str, params: Any, ds: dict) -> tuple[torch.optim.Optimizer, dict]:
    """The :data:`CLIENT_BUILT` optimizer ``name`` over ``params`` with the block's
    ``optimizer.params``, and the DeepSpeed config without the block (DeepSpeed would
    refuse the name) and with ``zero_allow_untested_optimizer`` (ZeRO steps it as any
    torch optimizer; HDET's DeepSpeed backend steps one group at a time for it).

    Raises:
        HDETConfigError: the optimizer's library is not installed.
    """
    if name not in OPTIMIZERS:
        raise HDETConfigError(f"optimizer.type: {name} needs the schedulefree package: pip install "
                              "\"hdet-scale[schedulefree]\"")
    kwargs = dict(ds["optimizer"].get("params") or {})
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    rest = {k: v for k, v in ds.items() if k != "optimizer"}
    rest["zero_allow_untested_optimizer"] = True
    return OPTIMIZERS[name](params, **kwargs), rest


def optimizer_class_name(name: Any) -> Any:
    """The :data:`OPTIMIZERS` key for ``name``, case-insensitive as DeepSpeed's
    ``optimizer.type`` (``adamw`` -> ``AdamW``); ``name`` itself when none matches."""
    if isinstance(name, str):
        for key in OPTIMIZERS:
            if key.lower() == name.lower():
                return key
    return name
