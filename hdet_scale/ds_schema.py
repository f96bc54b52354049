"""A snapshot of what :mod:`hdet_scale.ds_keys` asks DeepSpeed, for machines without it.

The key checks (:func:`hdet_scale.ds_keys.check_deepspeed_keys`) parse a config with
DeepSpeed's own ``DeepSpeedConfig`` and pydantic models. An FSDP2 / DDP user of
``hdet-train`` or ``hdet-dryrun`` has no DeepSpeed installed (the ``[fsdp]`` extra), and
reads the same DeepSpeed JSON: a misspelt ``train_micro_batch_size_per_gpuu``, a typo
inside ``zero_optimization`` or an ``"hdett"`` block must be refused there too. This
module writes, from the installed DeepSpeed, what those checks need into
``ds_schema.json`` (shipped in the wheel), and checks a config against it
(:func:`offline_problems`) when ``import deepspeed`` fails. With DeepSpeed installed,
the live parser is used and this file is not read.

Regenerate after a DeepSpeed upgrade (``tests/unit/test_ds_schema.py`` fails on drift)::

    python -m hdet_scale.ds_schema --write

The snapshot (JSON, every list sorted unless said otherwise):

- ``top_level``: the keys ``DeepSpeedConfig`` reads, in the order it first reads them;
- ``removed``: ``{key: message}``, removed features DeepSpeed refuses whatever the value;
- ``models``: ``{pydantic model: {"keys", "forbid", "sub": {key: model}, "nullable"}}``;
- ``blocks``: ``{top-level key: {"model": name}}`` for a block validated by a pydantic
  model, ``{"keys": [...]}`` for one DeepSpeed reads key by key (the union over a few
  probes: ``{}``, ``{"enabled": true}``, a typical optimizer / scheduler), and
  ``{"consumed": true}`` for one it takes whole (not checked);
- ``not_objects``: ``{key: {kind: fields}}``, the non-object values (kinds ``true``,
  ``false``, ``zero``, ``int``, ``float``, ``str``, ``list``, ``null``) DeepSpeed fails
  on where a block belongs, with the keys the message names;
- ``optimizers``: ``{type (+torch_adam): [what, accepted params]}`` for the optimizers
  DeepSpeed builds itself (``FusedAdam``...); ``torch.optim`` ones are read live.

What the snapshot does not reproduce (DeepSpeed absent only): the values DeepSpeed's
pydantic models refuse (a string for ``stage``), keys below the first level of a block
DeepSpeed reads key by key (``data_efficiency.data_sampling.*``), and its parser's own
assertions. A config is then checked less, never refused for something DeepSpeed takes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_schema.json")
# Representative non-object values for the "block given as a value" check, by kind.
_KINDS = {"true": True, "false": False, "zero": 0, "int": 5, "float": 1.5, "str": "x", "list": [1], "null": None}
# Optimizer types whose classes come from deepspeed.ops (hdet_scale.ds_values.optimizer_accepts).
_DS_OPTIMIZERS = (("adam", False), ("adamw", False), ("adam", True), ("adamw", True), ("adagrad", False),
                  ("lamb", False), ("lion", False))
_PROBE = "zz_hdet_probe"  # a key no DeepSpeed block has: the model that refuses it owns the block


def kind(value: Any) -> str:
    """The ``_KINDS`` name of a non-object JSON value (``5`` -> ``"int"``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "zero" if value == 0 else "int"
    return {float: "float", str: "str", list: "list", type(None): "null"}.get(type(value), "str")


def optimizer_key(lname: str, torch_adam: bool) -> str:
    return f"{lname}+torch_adam" if torch_adam else lname


# ---- extraction (needs DeepSpeed) ------------------------------------------------------------

class _OrderedSeen(dict):
    """A set that keeps the order of first insertion (``_Recorder.seen``)."""

    def add(self, key: Any) -> None:
        self.setdefault(key, None)


def _models() -> dict[str, dict]:
    from hdet_scale import ds_models

    out = {}
    for name, model in sorted(ds_models.pydantic_models().items()):
        sub, nullable = {}, []
        for field_name, f in model.model_fields.items():
            target = ds_models.sub_model(model, field_name)
            for key in {field_name, f.alias} - {None}:
                if target is not None:
                    sub[key] = target.__name__
                    if type(None) in _flat_args(f.annotation):
                        nullable.append(key)
        out[name] = {"keys": sorted(ds_models.model_keys(model)), "forbid": model.model_config.get("extra") == "forbid",
                     "sub": dict(sorted(sub.items())), "nullable": sorted(nullable)}
    return out


def _flat_args(annotation: Any) -> set:
    import typing

    todo, seen = [annotation], set()
    while todo:
        t = todo.pop()
        seen.add(t)
        todo.extend(typing.get_args(t))
    return seen


def _block(cls: Any, key: str, top: set) -> dict:
    """How DeepSpeed reads the top-level ``key`` when it holds an object; adds to ``top``
    the top-level keys it read meanwhile (some only when a block is enabled)."""
    from hdet_scale import ds_keys, ds_models

    failed, _ = ds_keys._alone(cls, key, {_PROBE: 1})
    for err in ds_models.pydantic_errors(failed):
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden" and loc and loc[-1] == _PROBE:
            model = ds_models.pydantic_models()[failed.title]
            for part in loc[:-1]:  # a block assembled from the root (the monitors): its own field
                model = ds_models.sub_model(model, part)
            return {"model": model.__name__}
    probes = [{}, {"enabled": True}]
    if key == "optimizer":
        probes.append({"type": "AdamW", "params": {"lr": 1e-3}})
    if key == "scheduler":
        probes.append({"type": "WarmupLR", "params": {}})
    keys: set = set()
    for probe in probes:
        _, rec = ds_keys._alone(cls, key, probe)
        top |= {k for k in rec.seen if isinstance(k, str)}
        node = rec.children.get(key)
        if node is not None and node.consumed:
            return {"consumed": True}
        keys |= {k for k in (node.seen if node is not None else ()) if isinstance(k, str)}
    return {"keys": sorted(keys)}


def extract() -> dict:
    """The snapshot, from the installed DeepSpeed (see the module docstring).

    Raises:
        ImportError: DeepSpeed is not installed.
    """
    import deepspeed

    from hdet_scale import ds_keys
    from hdet_scale.ds_values import optimizer_accepts

    cls = ds_keys._deepspeed_config_class()
    if cls is None:
        raise ImportError("deepspeed.runtime.config.DeepSpeedConfig cannot be imported")
    rec = ds_keys._Recorder({"train_micro_batch_size_per_gpu": 1})
    rec.seen = _OrderedSeen()
    with ds_keys._quiet():
        cls(rec)
    read = [k for k in rec.seen if isinstance(k, str)]
    top = read + sorted(set(ds_keys.valid_top_level_keys()) - set(read))
    removed, blocks, not_objects, also_read = {}, {}, {}, set()
    valid = ds_keys.valid_top_level_keys()
    for key in top:
        if key == ds_keys.HDET_KEY or key in ds_keys._BATCH_KEYS:
            continue
        failed, _ = ds_keys._alone(cls, key, {})
        if type(failed).__name__ == "DeepSpeedConfigError":
            removed[key] = str(failed)
            continue
        block = _block(cls, key, also_read) if key not in ds_keys._READ_ELSEWHERE else {}
        if any(block.values()):  # a scalar setting ({"keys": []}): nothing to check inside
            blocks[key] = block
        lines = {name: ds_keys._not_objects(cls, {key: value}, valid, "") for name, value in _KINDS.items()}
        found = {name: _fields_of(line[key]) for name, line in lines.items() if key in line}
        if found:
            not_objects[key] = found
    top += sorted(also_read - set(top))
    optimizers = {}
    for lname, torch_adam in _DS_OPTIMIZERS:
        got = optimizer_accepts({"optimizer": {"type": lname, "params": {"torch_adam": torch_adam}}})
        if got is not None:
            optimizers[optimizer_key(lname, torch_adam)] = [got[0], sorted(got[1])]
    return {"deepspeed": deepspeed.__version__, "top_level": top, "removed": removed, "models": _models(),
            "blocks": blocks, "not_objects": not_objects, "optimizers": optimizers}


def _fields_of(line: str) -> list[str]:
    """The part of ``object_line``'s message that depends on the block's keys, kept as
    the keys that reproduce it: ``["enabled"]`` for the ``{"enabled": true}`` example,
    the three named keys otherwise (``EXAMPLES`` keys need none)."""
    if '{"enabled": true}' in line:
        return ["enabled"]
    if "(keys such as " in line:
        return line.split("(keys such as ", 1)[1].split(")", 1)[0].split(", ")
    return []


def dumps(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=1, sort_keys=False) + "\n"


# ---- the offline check (no DeepSpeed) --------------------------------------------------------

@functools.lru_cache(maxsize=1)
def load() -> dict:
    """The shipped snapshot (``ds_schema.json`` beside this module).

    Raises:
        OSError: the file is missing (a broken install); ValueError: not valid JSON.
    """
    with open(PATH) as f:
        return json.load(f)


def snapshot_optimizer(lname: str, torch_adam: bool) -> tuple[str, set[str]] | None:
    """``(what, accepted params)`` of the optimizer DeepSpeed builds for ``lname``, from
    the snapshot; ``None`` when the snapshot does not know it."""
    got = load()["optimizers"].get(optimizer_key(lname, torch_adam))
    return (got[0], set(got[1])) if got else None


def _model_problems(schema: dict, model: str, node: Mapping, key: str, refused: list[str]) -> None:
    """pydantic's ``extra="forbid"`` on ``node`` (validated by ``model``), recursively:
    the lines :func:`hdet_scale.ds_keys._parse` writes for the same errors."""
    from hdet_scale.ds_keys import _suggest
    from hdet_scale.ds_models import object_line

    spec = schema["models"].get(model)
    if spec is None:
        return
    for k, v in node.items():
        sub = spec["sub"].get(k)
        if k not in spec["keys"]:
            if spec["forbid"]:
                refused.append(f"{key}{k}: unknown key, DeepSpeed refuses it; {_suggest(str(k), spec['keys'])}")
        elif sub is not None and isinstance(v, Mapping):
            _model_problems(schema, sub, v, f"{key}{k}.", refused)
        elif sub is not None and not (v is None and k in spec["nullable"]):
            refused.append(object_line(f"{key}{k}", v, set(schema["models"].get(sub, {}).get("keys", ()))))


def offline_problems(ds: Mapping, prefix: str = "") -> tuple[list[str], list[str]]:
    """What :func:`hdet_scale.ds_keys.find_problems` finds with DeepSpeed, from the
    snapshot: ``(refused, unknown)``, the lines in the same form and order (the
    ``optimizer.params`` lines aside: ``ds_values.optimizer_accepts`` answers those).
    Pure; the ``"hdet"`` block and the batch keys are not looked into.

    Raises:
        OSError, ValueError: the snapshot cannot be read (:func:`load`)."""
    from hdet_scale.ds_keys import _BATCH_KEYS, HDET_KEY, _suggest, looks_like_hdet
    from hdet_scale.ds_models import object_line

    schema = load()
    valid = frozenset(schema["top_level"])
    refused: list[str] = []
    unknown: list[str] = []
    given = {k: v for k, v in ds.items() if k in valid and k != HDET_KEY and k not in _BATCH_KEYS}
    not_objects = {}
    for k, v in given.items():
        fields = schema["not_objects"].get(k, {}).get(kind(v)) if not isinstance(v, Mapping) else None
        if fields is not None:
            not_objects[k] = object_line(f"{prefix}{k}", v, set(fields))
    refused.extend(not_objects.values())
    stopped = False
    for k in schema["top_level"]:  # DeepSpeed's order: a removed feature stops its parse there
        if k not in given or k in not_objects:
            continue
        if k in schema["removed"]:
            refused.append(f"{prefix.rstrip('.') or 'config'}: DeepSpeed refuses it: {schema['removed'][k]}")
            stopped = True
            break
        block = schema["blocks"].get(k, {})
        if "model" in block and isinstance(given[k], Mapping):
            _model_problems(schema, block["model"], given[k], f"{prefix}{k}.", refused)
    for k in ds:
        if k not in valid and not looks_like_hdet(k):
            unknown.append(f"{prefix}{k}: unknown DeepSpeed key (DeepSpeed would ignore it); {_suggest(str(k), valid)}")
    for k in [] if stopped else schema["top_level"]:
        keys = schema["blocks"].get(k, {}).get("keys")
        if k in given and k not in not_objects and keys and isinstance(given[k], Mapping):
            unknown.extend(f"{prefix}{k}.{sub}: unknown DeepSpeed key (DeepSpeed would ignore it); "
                           f"{_suggest(str(sub), keys)}" for sub in given[k] if sub not in keys)
    return refused, unknown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hdet_scale.ds_schema", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the snapshot to {PATH}")
    args = parser.parse_args(argv)
    text = dumps(extract())
    if args.write:
        with open(PATH, "w") as f:
            f.write(text)
        print(f"wrote {PATH}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
