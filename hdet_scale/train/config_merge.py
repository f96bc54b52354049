"""How the ``deepspeed`` section of the run config (run YAML and overrides) merges into
the DeepSpeed JSON, and the merges that cannot mean what they say: a list over an object
or the reverse (OmegaConf's bare TypeError), ``{}`` over a non-empty object (a merge that
changes nothing). Pure; used by ``train/config.py``'s ``load_run_config``.
"""

from __future__ import annotations

from typing import Any

from hdet_scale.errors import HDETConfigError


def _node(ds: dict, key: str) -> Any:
    """What ``deepspeed.<dotted key>`` names in the DeepSpeed JSON ``ds`` (``None``: nothing)."""
    node: Any = ds
    for part in key.split(".")[1:]:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def refuse_empty_over_full(overrides: list[str], ds: dict, ds_path: str) -> None:
    """``deepspeed.<key>={}`` where the DeepSpeed JSON has a non-empty object: overrides
    merge, so ``{}`` changes nothing (``deepspeed.hdet.axes={}`` would keep the packaged
    lr spread without a word)."""
    for o in overrides:
        key, value = (part.strip() for part in o.split("=", 1))
        if not key.startswith("deepspeed.") or value.replace(" ", "") != "{}":
            continue
        node = _node(ds, key)
        if isinstance(node, dict) and node:
            inner = next(iter(node))
            raise HDETConfigError(f"override {o!r}: overrides merge into {ds_path}, so {{}} changes nothing there (it "
                                  f"keeps {', '.join(map(str, node))}); set the keys inside it instead (e.g. "
                                  f"{key}.{inner}=...), or give your own deepspeed_config file")


def kept_by_merge(overrides: list[str], ds: dict, ds_path: str) -> list[str]:
    """Note lines for ``deepspeed.<key>={...}`` overrides (a mapping) over an object of the
    DeepSpeed JSON ``ds`` that has keys the mapping leaves out: overrides merge, so those
    stay (``deepspeed.hdet.axes={weight_decay: {...}}`` meant as "these axes only" would
    keep the packaged lr spread without a word). Never raises."""
    import yaml

    notes = []
    for o in overrides:
        key, _, value = (part.strip() for part in o.partition("="))
        if not key.startswith("deepspeed.") or not value.startswith("{"):
            continue
        try:
            given = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        node = _node(ds, key)
        if not isinstance(given, dict) or not given or not isinstance(node, dict):
            continue
        kept = [str(k) for k in node if k not in given]
        if kept:
            first = kept[0]
            notes.append(f"override {key}={{...}} merges into {ds_path}: its {', '.join(kept)} "
                         f"{'is' if len(kept) == 1 else 'are'} kept as there (to change {first}, set "
                         f"{key}.{first}.<key>=..." + (", e.g. spread_ratio=0 to drop the axis)" if key.endswith(".axes")
                                                       else ")"))
    return notes


def empty_over_full(given: Any, base: Any, key: str) -> tuple[str, list] | None:
    """The first ``(dotted key, kept keys)`` where ``given`` holds ``{}`` over a non-empty
    object of ``base``, or ``None``."""
    if not isinstance(given, dict) or not isinstance(base, dict):
        return None
    if not given and base:
        return key, list(base)
    for k, v in given.items():
        found = empty_over_full(v, base.get(k), f"{key}.{k}")
        if found:
            return found
    return None


def container_clash(base: Any, over: Any, key: str) -> str | None:
    """The first key where ``over`` puts a list over an object of ``base`` or the reverse
    (``deepspeed.hdet.axes=[lr, dropout]`` would be a traceback), as a message."""
    if isinstance(base, dict) and isinstance(over, dict):
        for k, v in over.items():
            found = container_clash(base.get(k), v, f"{key}.{k}") if k in base else None
            if found:
                return found
        return None
    kinds = {dict: "an object", list: "a list"}
    b, o = kinds.get(type(base)), kinds.get(type(over))
    if b and o and b != o:
        return f"{key}: expected {b} (as in the DeepSpeed config), got {o}: {over!r}"[:400]
    return None


def null_over_file_hint(overrides: list[str], ds: dict, ds_path: str, message: str) -> str | None:
    """The line added to a refusal of ``deepspeed.<key>=null`` where ``<key>`` is in the
    DeepSpeed JSON (``deepspeed.gradient_clipping=null``, meant as "leave it out", is
    refused as "must be a number >= 0, got None", which does not say how to leave it
    out). ``message``: the refusal's text; the hint is given only for a key it names."""
    for o in overrides:
        key, _, value = (part.strip() for part in o.partition("="))
        if not key.startswith("deepspeed.") or value not in ("null", "~", "Null", "NULL"):
            continue
        if _node(ds, key) is not None and f"{key}:" in message:
            return (f"{key}=null sets null, it does not remove {key.split('.', 1)[1]} from {ds_path} (overrides "
                    "merge into it): to leave the key out, give your own deepspeed_config file without it")
    return None
