"""DeepSpeed's pydantic config models, as :mod:`hdet_scale.ds_keys` reads them: every
model (:func:`pydantic_models`), its keys, the block of a config a model's error is about
(pydantic's ``loc`` is relative to the model's input), and the line naming a block given
as something other than a JSON object (:func:`object_line`). DeepSpeed is imported only
when called.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any

# The form of a block whose example is not {"enabled": true} (object_line: used where
# DeepSpeed's model has that key; otherwise a few of its keys are named).
EXAMPLES = {"optimizer": '{"type": "AdamW", "params": {"lr": 0.001}}', "zero_optimization": '{"stage": 3}',
            "scheduler": '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}',
            "offload_param": '{"device": "cpu"}', "params": '{"lr": 0.001}'}


def pydantic_models() -> dict[str, type]:
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    out, todo = {}, [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


def model_keys(model: type | None) -> set[str]:
    keys = set()
    for name, f in getattr(model, "model_fields", {}).items():
        keys.add(name)
        if f.alias:
            keys.add(f.alias)
    return keys


def sub_model(model: type, part: Any) -> type | None:
    from pydantic import BaseModel

    for name, f in model.model_fields.items():
        if part in (name, f.alias):
            todo = [f.annotation]
            while todo:
                t = todo.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    return t
                todo.extend(typing.get_args(t))
    return None


def find_block(root: dict, model: type, loc: tuple) -> str | None:
    """The dotted path of the block of ``root`` that ``model`` was validating when it
    raised at ``loc`` (pydantic's ``loc`` is relative to the model's own input)."""
    fields = model_keys(model)
    best, best_fit = None, -1
    todo: list[tuple[str, Any]] = [("", root)]  # the root too: some blocks are assembled from top-level keys
    while todo:
        path, node = todo.pop()
        target: Any = node
        for part in loc[:-1]:
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict) and loc and loc[-1] in target:
            fit = len(set(node) & fields)
            if fit > best_fit:
                best, best_fit = path, fit
        todo.extend((f"{path}{k}.", v) for k, v in node.items() if isinstance(v, dict))
    return best


def drop(root: dict, path: str, loc: tuple) -> bool:
    node: Any = root
    for part in [p for p in path.split(".") if p] + list(loc[:-1]):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and loc and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


def pydantic_errors(e: Exception) -> list[dict]:
    """The error dicts of a pydantic ``ValidationError``; ``[]`` for any other exception."""
    errors = getattr(e, "errors", None)
    return errors() if callable(errors) and type(e).__name__ == "ValidationError" else []


def model_fields(e: Exception) -> set[str]:
    """The keys of the pydantic models named in DeepSpeed's error ``e`` (``Model()``
    argument after ** must be a mapping; pydantic's ``class_name``)."""
    names = re.findall(r"(\w+)\(\) argument after \*\*", str(e))
    names += [err.get("ctx", {}).get("class_name") for err in pydantic_errors(e)]
    models = pydantic_models()
    return set().union(*(model_keys(models[n]) for n in names if n in models))


def object_line(key: str, value: Any, fields: set) -> str:
    """The error line for the block ``key`` (dotted) given as ``value``, not a JSON object;
    ``fields``: the block's keys, for the example."""
    example = EXAMPLES.get(key.rsplit(".", 1)[-1]) or ('{"enabled": true}' if "enabled" in fields else None)
    form = (f", e.g. {example}" if example else
            f" (keys such as {', '.join(sorted(fields)[:3])})" if fields else " of DeepSpeed settings")
    return f"{key}: must be a JSON object{form}; got {json.dumps(value, default=repr)}"
