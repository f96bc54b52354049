"""``deepspeed.optimizer.type=SGD`` over a DeepSpeed JSON written for another optimizer.

Overrides merge into the DeepSpeed JSON (the packaged one, or ``deepspeed_config``), so a
new ``optimizer.type`` would keep the file's ``optimizer.params``: the packaged AdamW's
``betas`` and ``eps`` would go to SGD, which refuses them, and ``null`` cannot remove a
key. A type change from the command line or the YAML is a new optimizer:
the file's params that the new type does not take are dropped, the ones it takes (``lr``,
``weight_decay``) are kept, and params the user set next to the type are kept as given
(a wrong one is still refused, naming it). One note says what was dropped and from where.

The same for ``deepspeed.hdet.schedule.name``: a new schedule over the file's drops the
file's keys of the old one (otherwise ``schedule.name=constant`` over the packaged
OneCycle block warns that ``pct_start`` and ``final_div_factor`` are not read and says
"remove them", which no override can do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _type(ds: Any) -> str | None:
    opt = ds.get("optimizer") if isinstance(ds, Mapping) else None
    kind = opt.get("type") if isinstance(opt, Mapping) else None
    return kind if isinstance(kind, str) else None


def drop_foreign_params(file_ds: Mapping, given: Mapping, merged: dict, torch_engine: bool = False) -> None:
    """Remove from ``merged["optimizer"]["params"]`` (in place) the params that came from
    the file ``file_ds`` only, when ``given`` (the user's ``deepspeed`` section) changes
    ``optimizer.type``, and the new type's optimizer does not accept them
    (``ds_values.optimizer_accepts``: imports torch, so only on a type change). An
    unknown type, or one whose constructor takes ``**kwargs``, drops nothing (the checks
    name what is wrong). ``torch_engine``: the ddp / fsdp2 / fairscale engines, which take
    the type in any case (``sgd`` is SGD, so the file's betas must not reach it, where
    they are refused); DeepSpeed looks torch.optim classes up by their exact
    name. Never raises."""
    old, new = _type(file_ds), _type(given)
    if old is None or new is None or old.lower() == new.lower():
        return
    params = merged["optimizer"].get("params")
    file_params = file_ds["optimizer"].get("params")
    if not isinstance(params, dict) or not isinstance(file_params, Mapping):
        return
    own = given["optimizer"].get("params")
    own = set(own) if isinstance(own, Mapping) else set()
    from hdet_scale.ds_values import optimizer_accepts

    if torch_engine:
        from hdet_scale.engine_config import optimizer_class_name

        merged = {**merged, "optimizer": {**merged["optimizer"], "type": optimizer_class_name(new)}}
    found = optimizer_accepts(merged)
    if found is None:
        return
    for key in [k for k in file_params if k not in own and k not in found[1]]:
        params.pop(key, None)


def switch_note(file_ds: Mapping, merged: Mapping, ds_path: str) -> str | None:
    """The note for :func:`drop_foreign_params`' work: which params of ``ds_path`` the new
    type left out, or ``None`` when it dropped nothing."""
    old, new = _type(file_ds), _type(merged)
    if old is None or new is None or old.lower() == new.lower():
        return None
    file_params = file_ds["optimizer"].get("params")
    params = merged["optimizer"].get("params")
    if not isinstance(file_params, Mapping) or not isinstance(params, Mapping):
        return None
    dropped = [k for k in file_params if k not in params]
    if not dropped:
        return None
    kept = [k for k in file_params if k in params]
    return (f"deepspeed.optimizer.type={new} replaces {ds_path}'s {old}: its optimizer.params "
            f"{', '.join(dropped)} are not {new}'s and are left out"
            + (f" ({', '.join(kept)} kept)" if kept else ""))


def _schedule(ds: Any) -> Mapping | None:
    hdet = ds.get("hdet") if isinstance(ds, Mapping) else None
    sched = hdet.get("schedule") if isinstance(hdet, Mapping) else None
    return sched if isinstance(sched, Mapping) else None


def _schedule_change(file_ds: Any, given: Any) -> tuple[str, str] | None:
    old, new = _schedule(file_ds), _schedule(given)
    if old is None or new is None or not isinstance(new.get("name"), str):
        return None
    old_name = old.get("name", "onecycle")  # HDETConfig's default schedule
    return (old_name, new["name"]) if isinstance(old_name, str) and old_name != new["name"] else None


def drop_foreign_schedule(file_ds: Mapping, given: Mapping, merged: dict) -> None:
    """Remove from ``merged["hdet"]["schedule"]`` (in place) the keys that came from the
    file ``file_ds`` only, when ``given`` changes ``hdet.schedule.name`` and the new
    schedule does not read them (``config.SCHEDULE_READS``; the momentum pair stays with
    ``cycle_momentum``). Keys the user set beside the name stay (the checks then name
    any the schedule does not read). An unknown name drops nothing. Never raises."""
    from hdet_scale.config import SCHEDULE_READS

    change = _schedule_change(file_ds, given)
    if change is None or change[1] not in SCHEDULE_READS or change[0] not in SCHEDULE_READS:
        return
    own = set(_schedule(given))
    reads = SCHEDULE_READS[change[1]] | {"name", "total_steps", "max_lr", "base_momentum", "max_momentum"}
    for key in [k for k in _schedule(file_ds) if k not in own and k not in reads]:
        merged["hdet"]["schedule"].pop(key, None)


def schedule_switch_note(file_ds: Mapping, merged: Mapping, ds_path: str) -> str | None:
    """The note for :func:`drop_foreign_schedule`'s work, or ``None`` when it dropped nothing."""
    change = _schedule_change(file_ds, merged)
    if change is None:
        return None
    dropped = [k for k in _schedule(file_ds) if k not in _schedule(merged)]
    if not dropped:
        return None
    return (f"deepspeed.hdet.schedule.name={change[1]} replaces {ds_path}'s {change[0]} schedule: its "
            f"{', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} {change[0]}'s and left out")
