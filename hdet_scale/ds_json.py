"""Reading a DeepSpeed JSON file as DeepSpeed does: one object, no key given twice.

Python's ``json`` keeps the last of a repeated key silently; DeepSpeed refuses such a
file (``deepspeed.runtime.config``'s ``dict_raise_error_on_duplicate_keys``), so a
``hdet-train`` / ``hdet-dryrun`` check that read it with ``json`` would judge another
config than the one DeepSpeed then refuses. Used by ``hdet-train``, ``hdet-dryrun``,
``hdet_scale.initialize`` and the cost model.
"""

from __future__ import annotations

import os
import re
from typing import Any

from hdet_scale.errors import HDETConfigError


class RepeatedKeyError(ValueError):
    """A JSON object that has the same key twice; ``key``: that key. The message reads
    after the file's name (``f"{path!r} {e}"``)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"has the key {key!r} twice in one object: keep one (DeepSpeed refuses such a "
                         "file; Python's json would keep the last silently)")
        self.key = key


def _unique_pairs(pairs: list) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise RepeatedKeyError(k)
        seen[k] = v
    return seen


def loads_json(text: str) -> Any:
    """``json.loads`` that refuses an object with a key twice, as DeepSpeed does when it
    reads a config file (``hdet-train``, ``hdet-dryrun`` and ``hdet_scale.initialize``
    all read DeepSpeed JSON through this).

    Raises:
        RepeatedKeyError: a key given twice (a ``ValueError``, naming the key).
        ValueError: not valid JSON (``json.JSONDecodeError``), or nested too deeply
            (``safe_parse.TooDeepError``, not a RecursionError traceback).
    """
    from hdet_scale.safe_parse import json_loads

    return json_loads(text, object_pairs_hook=_unique_pairs)


def loads_json_object(text: str, where: str) -> dict:
    """:func:`loads_json` of a DeepSpeed config file, which must hold one JSON object;
    ``where`` names the file at the start of each message (``"DeepSpeed config 'x.json'"``).

    Raises:
        HDETConfigError: a key given twice, or another JSON value than an object.
        ValueError: not valid JSON (callers word it their own way).
    """
    try:
        value = loads_json(text)
    except RepeatedKeyError as e:
        raise HDETConfigError(f"{where} {e}") from None
    if not isinstance(value, dict):
        # JSON's own names (not "got a JSON NoneType", "a JSON str")
        kind = {type(None): "null", str: "string", list: "array", bool: "true/false", int: "number",
                float: "number"}.get(type(value), type(value).__name__)
        raise HDETConfigError(f"{where} must hold a JSON object ({{\"hdet\": {{...}}, ...}}), got a JSON {kind}")
    return value


def read_for_check(config: str | dict) -> Any:
    """``config`` (a path or an already-read dict) read as ``hdet-dryrun`` reads it: the
    library's reader (``backends.ds_prepare.load_ds_config``: JSON, a key given twice
    refused) with a one-line :class:`HDETConfigError` for a file that is missing, empty,
    not UTF-8, not JSON or YAML by mistake. Returns the parsed
    value, which may not be a dict (the caller names that)."""
    from hdet_scale.backends.ds_prepare import load_ds_config as _load_ds_config

    try:
        return _load_ds_config(config)
    except HDETConfigError:
        raise  # a key given twice: the message names the file and the key already
    except UnicodeDecodeError as e:  # random bytes in a .yaml are not called YAML
        raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: it is not UTF-8 text (byte {e.start}): is "
                              "it the right file?") from None
    except (OSError, ValueError, TypeError) as e:
        if _empty(config):  # an empty .yaml is not called YAML either
            raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: the file is empty; it must hold a "
                                  "DeepSpeed JSON object") from None
        raise HDETConfigError(f"cannot read the DeepSpeed JSON {config!r}: {e}{_yaml_hint(config, e)}") from None


def _empty(path: object) -> bool:
    """Whether the file ``path`` holds nothing but whitespace. Raises nothing."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):  # never a FIFO's open
        return False
    try:
        with open(path, "rb") as f:
            return not f.read(1 << 16).strip() and os.path.getsize(path) <= 1 << 16
    except OSError:
        return False


def _yaml_hint(path: object, error: Exception) -> str:
    """A hint when ``path`` failed as JSON and looks like YAML (by its name, or a first
    line ``key: ...``): most likely an ``hdet-train`` run config; empty otherwise."""
    if not isinstance(error, ValueError) or not isinstance(path, (str, os.PathLike)):
        return ""
    looks = os.fspath(path).endswith((".yaml", ".yml"))
    if not looks:
        try:
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip() and not line.lstrip().startswith("#")), "")
            looks = re.match(r"^[A-Za-z_][\w.-]*\s*:(\s|$)", first) is not None
        except (OSError, ValueError):
            return ""
    return ("; this looks like YAML (an hdet-train run config?); hdet-dryrun reads a DeepSpeed JSON (the file "
            "hdet-train's deepspeed_config= names)") if looks else ""
