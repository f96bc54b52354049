"""Reading the trainer's files: the text of a config file and the DeepSpeed JSON of
``deepspeed_config``, and the YAML 1.1 spellings that do not mean what they look like.

Each function raises :class:`~hdet_scale.errors.HDETConfigError` with one line naming the
file (and the line or key) and what is expected; nothing here starts a process.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from hdet_scale.ds_json import loads_json_object
from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import require_regular
from hdet_scale.safe_parse import TooDeepError, yaml_compose

#: YAML 1.1 booleans that YAML 1.2 (and hdet-train) read as strings.
YAML11_BOOLS = ("yes", "no", "on", "off", "y", "n")


def relative_note(path: str) -> str:
    """For a path that names nothing: where a relative one was looked for. A path inside a
    YAML file is read from the working directory, as on the command line (and as
    Accelerate reads ``deepspeed_config_file``), not from the YAML file's folder."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (a relative path is read from the working directory {os.getcwd()}, not from a config file's folder)"


def read_text(path: str, what: str) -> str:
    """The text of ``path``; HDETConfigError naming ``what`` and the file otherwise."""
    if not os.path.exists(path):
        raise HDETConfigError(f"{what} {path!r} does not exist{relative_note(path)}")
    if os.path.isdir(path):
        raise HDETConfigError(f"{what} {path!r} is a folder, not a file")
    require_regular(path, what)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise HDETConfigError(f"{what} {path!r} is not UTF-8 text (byte {e.start}): is it the right file?") from None
    except OSError as e:
        raise HDETConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None


OCTAL = re.compile(r"[+-]?0[0-9_]+")


def ambiguous(value: str) -> str | None:
    """Why a plain YAML scalar does not mean what it looks like (``steps: 010`` would
    train 8 steps, ``project: no`` name a W&B project "False"), or None."""
    if value.strip().lower() in YAML11_BOOLS:
        return "YAML 1.1's spelling of a boolean, which hdet-train does not take"
    if OCTAL.fullmatch(value.strip()):
        return f"an octal number in YAML 1.1 ({value.strip()} = {int(value.strip().replace('_', ''), 8)})" \
            if all(c in "01234567_+-" for c in value.strip()) else "a number with a leading 0"
    return None


def yaml11_scalar(text: str) -> tuple[str, int, str, str] | None:
    """``(dotted key, line, value, why)`` of the first unquoted value of the YAML ``text``
    that :func:`ambiguous` names, or ``None``. Raises what ``safe_parse.yaml_load`` raises."""
    todo = [("", yaml_compose(text))]  # a tree: an alias cycle would make this loop endless
    while todo:
        path, node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            todo.extend((f"{path}{k.value}." if isinstance(k, yaml.ScalarNode) else path, v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((f"{path}{i}.", v) for i, v in enumerate(node.value))
        elif isinstance(node, yaml.ScalarNode) and node.style is None and (why := ambiguous(node.value)):
            return path.rstrip("."), node.start_mark.line + 1, node.value, why
    return None


def repeated_key(text: str) -> tuple[str, int, int] | None:
    """``(dotted key, first line, second line)`` of the first key given twice in one
    mapping of the YAML ``text`` (PyYAML keeps the last silently), or ``None``. Raises
    what ``safe_parse.yaml_load`` raises."""
    todo = [("", yaml_compose(text))]  # a tree
    while todo:
        path, node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else None
                if name is not None and name in lines:
                    return f"{path}{name}", lines[name], k.start_mark.line + 1
                lines[name] = k.start_mark.line + 1
                todo.append((f"{path}{name}.", v))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((f"{path}{i}.", v) for i, v in enumerate(node.value))
    return None


def load_deepspeed_json(path: str) -> dict:
    """The DeepSpeed JSON of ``deepspeed_config``: one JSON object.

    Raises:
        HDETConfigError: the file is missing, unreadable, empty, not JSON, nested too
            deeply, not an object, or a Hugging Face model config.
    """
    text = read_text(path, "deepspeed_config: file")
    if not text.strip():
        raise HDETConfigError(f"deepspeed_config: file {path!r} is empty; it must hold a DeepSpeed JSON object")
    try:
        ds = loads_json_object(text, f"deepspeed_config: file {path!r}")
    except HDETConfigError:
        raise
    except TooDeepError as e:  # not a RecursionError traceback
        raise HDETConfigError(f"deepspeed_config: file {path!r} {e}") from None
    except ValueError as e:
        raise HDETConfigError(f"deepspeed_config: file {path!r} is not valid JSON: {e}") from None
    from hdet_scale.ds_keys import hf_model_type

    if hf_model_type(ds) is not None:  # one line, not 30 unknown keys
        raise HDETConfigError(f"deepspeed_config: file {path!r} is a Hugging Face model config (model_type "
                              f"{hf_model_type(ds)!r}), not a DeepSpeed config; hdet-train's model is set by the "
                              "model.* keys (docs/config.md), the DeepSpeed JSON holds the optimizer, batch keys "
                              "and the hdet block")
    return ds
