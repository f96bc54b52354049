"""OmegaConf's errors about the run config in one line each (``describe``): the dotted
key, and what to write instead; split from ``train/config.py``, which raises them as
:class:`HDETConfigError` when it reads the YAML and the overrides."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hdet_scale.backends import BACKENDS


def describe(e: Exception, cfg: Any = None, overrides: list[str] = (), path: str | None = None,
             merging: str | None = None) -> str:
    """One line naming the dotted key, and for an unknown key the valid ones; for an
    interpolation that cannot be resolved, the interpolation and where it was set
    (``cfg``: the merged config, ``overrides`` and ``path``: the user's)."""
    from omegaconf.errors import GrammarParseError, InterpolationResolutionError

    key = getattr(e, "full_key", None) or ""
    msg = getattr(e, "msg", None) or str(e)
    msg = msg.splitlines()[0]
    if isinstance(e, (InterpolationResolutionError, GrammarParseError)) and key:
        setter = [o for o in overrides if o.split("=", 1)[0] == key]
        where = (f"override {setter[-1]!r}" if setter else f"config file {path!r}" if path is not None
                 else "the packaged defaults")
        raw = _raw_value(cfg, key)
        shown = f"the interpolation {raw!r}" if isinstance(raw, str) and "${" in raw else "its interpolation"
        return (f"{key}: {shown} ({where}) cannot be resolved: {msg}. Interpolations are resolved when the "
                "config is read; write a literal ${ as \\${")
    if "not in" in msg and key:
        from hdet_scale.train.config import RunConfig  # here: config.py imports this module

        node: Any = RunConfig
        for part in key.split(".")[:-1]:
            fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
            node = fields[part].default_factory() if part in fields and fields[part].default_factory \
                is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(node):
            valid = ", ".join(f.name for f in dataclasses.fields(node))
            return f"{key}: unknown key; valid keys: {valid}"
    if msg.startswith("Incompatible value 'None'") and key:
        # `key=` on the command line (an unset shell variable) gives None, and the field
        # takes no None: say so, with what it takes, not omegaconf's type words
        kind = msg.rsplit("of type ", 1)[-1].strip(".' ")
        kinds = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
        valid = f"one of {', '.join(BACKENDS)}" if key == "backend" else kinds.get(kind, kind)
        return f"{key}: empty or null value ({key}= on the command line; an unset shell variable?): give {valid}"
    converted = re.fullmatch(r"Value '(.*)' of type '(\w+)' could not be converted to (Integer|Float|Boolean)", msg)
    if converted and key:
        # not OmegaConf's words, and a YAML's value names its file
        value, kind, target = converted.groups()
        setter = [o for o in overrides if o.split("=", 1)[0].strip() == key]
        where = (f"config file {path!r}" if merging == "file" else f"override {setter[-1]!r}" if setter
                 else f"config file {path!r}" if path is not None else "")
        want = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}[target]
        kinds = {"float": "a float", "str": "a string", "int": "an integer", "bool": "a boolean"}
        return f"{key}: expected {want}, got {value} ({kinds.get(kind, kind)}{', ' + where if where else ''})"
    if msg.startswith("Cannot convert 'ListConfig' to string") and key:
        return f"{key}: {_list_for_string(key, msg)}"
    return f"{key}: {msg}" if key else msg


def _list_for_string(key: str, msg: str) -> str:
    """OmegaConf's "Cannot convert 'ListConfig' to string: '[...]'" in words: a key that
    takes one string was given a list; ``data.path`` takes several as one comma-separated
    string (``data.load_corpus``), shown with the list's own items."""
    import ast
    import re

    found = re.search(r": '(\[.*\])'$", msg)
    try:
        items = [str(x) for x in ast.literal_eval(found.group(1))] if found else []
    except (ValueError, SyntaxError):
        items = []
    text = f"expected one string, got a list{' ' + repr(items) if items else ''}"
    if key == "data.path":
        example = ",".join(items) if items else "a.txt,b.txt"
        text += f"; give several files or folders as one comma-separated string: data.path={example}"
    return text


def _raw_value(cfg: Any, key: str) -> Any:
    """The value of the dotted ``key`` in the OmegaConf ``cfg`` as written (unresolved), or ``None``."""
    from omegaconf import OmegaConf

    if cfg is None:
        return None
    try:
        node: Any = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # a config OmegaConf cannot even copy: the message names the key anyway
        return None
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
