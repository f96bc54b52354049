"""Parsing a user's YAML or JSON text into plain values that every later walk can take.

Unchecked, ``a: &a [*a]`` (a YAML anchor used inside its own value) makes
``hdet-train`` spin for ever before any rank starts (the key walks of
``train.config_files`` never end on the node that contains itself), and a JSON or YAML
nested 100000 levels deep ends in a ``RecursionError`` traceback. Every reader of a file
the user gives (the run config YAML, the DeepSpeed JSON, ``--hf-config``, the checkpoint
records read on resume, ``hdet-plot``'s files) parses through here, so each turns those
into its own one-line error: both failures are :class:`ValueError`\\ s, which the readers
already catch for text that is not JSON / YAML.

A value returned is a tree: no YAML alias refers to a value it is part of, it is at most
:data:`MAX_DEPTH` levels deep (OmegaConf and the recursive key checks have room for
that), and a YAML's aliases expand to at most :data:`MAX_VALUES` values (shared
anchors are fine, an alias "billion laughs" is not).
"""

from __future__ import annotations

import json
from typing import IO, Any

import yaml

#: Levels of nested lists / mappings a file may have: real ones have under 10, and
#: OmegaConf's merge of the run config raised RecursionError at about 75.
MAX_DEPTH = 32
#: Values a YAML may expand to once every alias is written out (a config has hundreds).
MAX_VALUES = 1_000_000


class TooDeepError(ValueError):
    """The text nests lists / mappings more than :data:`MAX_DEPTH` levels deep (or deeper
    than Python's parser can go). Reads after the file's name."""

    def __init__(self) -> None:
        super().__init__(f"nests lists / mappings more than {MAX_DEPTH} levels deep: a config is not nested "
                         "that deep (a damaged or generated file?)")


class RecursiveAliasError(ValueError):
    """A YAML anchor used inside its own value: the value would contain itself. Reads
    after the file's name; ``anchor``: its name, ``line``: where it is set (1-based)."""

    def __init__(self, anchor: str | None, line: int) -> None:
        name = f"&{anchor}" if anchor else "an anchor"
        alias = f"*{anchor}" if anchor else "its alias"
        super().__init__(f"holds a recursive alias: the anchor {name} (line {line}) is used inside its own value "
                         f"({alias}), so the value would contain itself; write the value out instead")
        self.anchor, self.line = anchor, line


class TooManyValuesError(ValueError):
    """The YAML's aliases expand to more than :data:`MAX_VALUES` values."""

    def __init__(self) -> None:
        super().__init__(f"expands to more than {MAX_VALUES} values once its aliases are written out (aliases of "
                         "aliases): a config is not that large")


def json_loads(text: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(text, **kwargs)`` whose result is a tree at most :data:`MAX_DEPTH` deep.

    Raises:
        TooDeepError: nested deeper (a ``ValueError``, as Python's ``RecursionError``
            from the parser would not be).
        ValueError: not valid JSON (``json.JSONDecodeError``), or what a hook raises.
    """
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise TooDeepError() from None
    _check_depth(value)
    return value


def json_load(f: IO[str], **kwargs: Any) -> Any:
    """:func:`json_loads` of the open file ``f``'s text.

    Raises:
        OSError: reading ``f`` failed.
        TooDeepError, ValueError: as :func:`json_loads`.
    """
    return json_loads(f.read(), **kwargs)


def _check_depth(value: Any) -> None:
    """Raise :class:`TooDeepError` when ``value`` (parsed JSON: a tree) nests more than
    :data:`MAX_DEPTH` levels. Iterative: it must not itself recurse."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise TooDeepError()
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, keeping each anchor's name for :class:`RecursiveAliasError`."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.anchor_names: dict[int, str] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        anchor = None if self.check_event(yaml.AliasEvent) else getattr(self.peek_event(), "anchor", None)
        node = super().compose_node(parent, index)
        if anchor is not None:
            self.anchor_names[id(node)] = anchor
        return node


def yaml_load(text: str) -> Any:
    """``yaml.safe_load(text)`` whose result is a tree (see the module's docstring).

    Raises:
        yaml.YAMLError: not valid YAML (its message names the line).
        RecursiveAliasError: an anchor used inside its own value.
        TooDeepError: nested more than :data:`MAX_DEPTH` levels.
        TooManyValuesError: aliases expanding to more than :data:`MAX_VALUES` values.
        (All three are ``ValueError``\\ s.)
    """
    loader = _Loader(text)
    try:
        node = _checked_node(loader)  # before a value is built from a cyclic node
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_compose(text: str) -> yaml.Node | None:
    """``yaml.compose(text, Loader=yaml.SafeLoader)`` checked as :func:`yaml_load` checks
    it, for walks over the nodes (their lines). Raises what :func:`yaml_load` raises."""
    loader = _Loader(text)
    try:
        return _checked_node(loader)
    finally:
        loader.dispose()


def _checked_node(loader: _Loader) -> yaml.Node | None:
    try:
        node = loader.get_single_node()
    except RecursionError:  # PyYAML's composer recurses once per level
        raise TooDeepError() from None
    if node is not None:
        check_yaml_nodes(node, loader.anchor_names)
    return node


def check_yaml_nodes(root: yaml.Node, anchor_names: dict[int, str] | None = None) -> None:
    """Check the composed YAML ``root`` (``yaml.compose``'s node graph, which an alias
    makes a graph, not a tree) before anything walks it or builds a value from it.

    Raises:
        RecursiveAliasError, TooDeepError, TooManyValuesError: see :func:`yaml_load`.
    """
    # Depth-first without recursion; `done` maps a finished node to (its levels of lists /
    # mappings, values it expands to), so a shared anchor is walked once and the totals
    # stay exact. len(stack) is the depth of the node on top (the root's is 1).
    done: dict[int, tuple[int, int]] = {}
    on_path = {id(root)}
    stack: list[list] = [[root, iter(_children(root)), 0, 1]]  # node, children left, max child height, values
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            on_path.discard(id(frame[0]))
            height = frame[2] + 1 if isinstance(frame[0], yaml.CollectionNode) else 0
            done[id(frame[0])] = (height, frame[3])
            if stack:
                stack[-1][2] = max(stack[-1][2], height)
                stack[-1][3] += frame[3]
                if stack[-1][3] > MAX_VALUES:
                    raise TooManyValuesError()
            continue
        if id(child) in on_path:
            raise RecursiveAliasError((anchor_names or {}).get(id(child)), child.start_mark.line + 1)
        if id(child) in done:
            height, values = done[id(child)]
            if len(stack) + height > MAX_DEPTH:
                raise TooDeepError()
            frame[2], frame[3] = max(frame[2], height), frame[3] + values
            if frame[3] > MAX_VALUES:
                raise TooManyValuesError()
            continue
        if len(stack) >= MAX_DEPTH and isinstance(child, yaml.CollectionNode):
            raise TooDeepError()
        on_path.add(id(child))
        stack.append([child, iter(_children(child)), 0, 1])


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []
