"""Reading a DeepSpeed JSON file as DeepSpeed does: one object, no key given twice.

Python's ``json`` keeps the last of a repeated key silently; DeepSpeed refuses such a
file (``deepspeed.runtime.config``'s ``dict_raise_error_on_duplicate_keys``), so a
``hdet-train`` / ``hdet-dryrun`` check that read it with ``json`` would judge another
config than the one DeepSpeed then refuses. Used by ``hdet-train``, ``hdet-dryrun``,
``hdet_scale.initialize`` and the cost model.
"""

from __future__ import annotations

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
