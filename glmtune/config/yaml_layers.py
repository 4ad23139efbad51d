"""Config sources: YAML recipe files (with `extends:`) and dotted command-line overrides.

Each source becomes a `Layer`: a plain nested dict plus, for every key path in it,
where that value was written (`recipes/x.yaml:12` or `command line (--optim.lr=2e-5)`).
Layers are deep-merged in order, later winning, and the typed conversion in
`loader.py` uses the locations to point each error at the line the user must fix.

We walk PyYAML's composed node tree instead of calling `safe_load`, because only
nodes carry line numbers; scalars are still built by PyYAML's safe constructor, so
values mean exactly what `safe_load` would give (YAML 1.1: `2e-5` is a string).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from glmtune.io.regular import open_regular

# A key path into the config tree: section and field names, list indices as ints.
KeyPath = tuple[Any, ...]


@dataclass
class Layer:
    """A partial config and the location each of its key paths came from."""

    data: dict[str, Any] = field(default_factory=dict)
    where: dict[KeyPath, str] = field(default_factory=dict)


def format_path(path: KeyPath) -> str:
    """`("optim", "betas", 1)` -> `optim.betas[1]`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


# --------------------------------------------------------------------------- YAML files


# A recipe is a few KiB (the largest shipped one under 4 KiB); anything near this is not a recipe.
MAX_RECIPE_BYTES = 1 << 20
# Sections, fields, and a few levels of values (model.overrides, data.split) need far fewer.
MAX_YAML_DEPTH = 64


class _Refused(Exception):
    """A YAML construct refused while composing: the line it is on and what to say about it."""

    def __init__(self, mark: yaml.Mark, message: str):
        super().__init__(message)
        self.line = mark.line + 1


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader without aliases, and with nesting bounded.

    An alias (`*name`) repeats the anchored node: nine lines of aliases to aliases
    (`b: &b [*a, *a, ...]`) compose into a handful of nodes that our walk, which expands
    them, turns into billions. Recipes reuse values with `extends:` instead, so aliases
    are refused where they are met. An anchor alone (`&name`) only labels a node and
    copies nothing: it is harmless and allowed. PyYAML composes recursively, so depth is
    bounded too (a file of `[[[[...` would end in RecursionError).
    """

    def __init__(self, stream, kind: str):
        super().__init__(stream)
        self._kind = kind  # what the text is, for the message: "recipe", "suite", "command-line value"
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(event.start_mark, f"YAML aliases (*{event.anchor}) are not allowed in a {self._kind}; "
                                             "write the value out")
        if self._depth >= MAX_YAML_DEPTH:
            raise _Refused(self.peek_event().start_mark, f"nested deeper than {MAX_YAML_DEPTH} levels")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _compose(text: str, name: str, kind: str) -> yaml.Node | None:
    """The node tree of one YAML document; `_Refused` as ValueError naming `name`:line."""
    stream = io.StringIO(text)
    stream.name = name  # YAML's own error marks name the file
    loader = _PlainLoader(stream, kind)
    try:
        return loader.get_single_node()
    except _Refused as exc:
        raise ValueError(f"{name}:{exc.line}: {exc}") from None
    finally:
        loader.dispose()


def _read_text(path: Path, label: str, kind: str, max_bytes: int) -> str:
    """The file as UTF-8 text, at most `max_bytes`; else one line naming the file (and line, column)."""
    with open_regular(path, kind) as stream:  # a FIFO would block the read
        data = stream.read(max_bytes + 1)  # bounded even for a file that grows or lies about its size
    if len(data) > max_bytes:
        raise ValueError(f"{label}: more than {max_bytes:,} bytes, too large for a {kind} (a few KiB is usual)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{label}:{line}: byte 0x{data[exc.start]:02x} at column {column} is not UTF-8; "
                         f"save the {kind} as UTF-8") from None


def read_yaml_layer(path: Path, *, kind: str = "recipe", max_bytes: int = MAX_RECIPE_BYTES) -> Layer:
    """Parse one YAML file into a Layer, recording the line of every key and list item.

    `kind` names the file in errors ("recipe", "suite"). Refused, each in one line: more
    than `max_bytes`, text that is not UTF-8, aliases (`*name`), nesting over MAX_YAML_DEPTH.
    """
    label = os.path.normpath(str(path))
    text = _read_text(Path(path), label, kind, max_bytes)
    try:
        root = _compose(text, label, kind)
    except yaml.YAMLError as exc:
        raise ValueError(f"{label}: invalid YAML: {exc}") from None
    if root is None:  # empty file, or comments only
        return Layer()
    if not isinstance(root, yaml.MappingNode):
        raise ValueError(f"{label}:{root.start_mark.line + 1}: a {kind} must be a mapping of sections")
    layer = Layer()
    # One constructor for the whole file: it only turns scalar nodes into Python values.
    constructor = yaml.SafeLoader("")
    try:
        layer.data = _walk(root, (), label, constructor, layer.where)
    except yaml.YAMLError as exc:  # e.g. a `!!python/object` tag the safe constructor refuses
        raise ValueError(f"{label}: invalid YAML: {exc}") from None
    return layer


def load_yaml_text(text: str, name: str, kind: str = "config") -> Any:
    """`yaml.safe_load(text)` with aliases refused and nesting bounded (for YAML glmtune wrote
    and reads back, e.g. a run's config.yaml, which whoever can write the run directory controls);
    a refusal or a syntax error is a ValueError naming `name`."""
    try:
        root = _compose(text, name, kind)
        return None if root is None else yaml.SafeLoader("").construct_document(root)
    except yaml.YAMLError as exc:
        raise ValueError(f"{name}: invalid YAML: {exc}") from None


def _walk(node: yaml.Node, path: KeyPath, label: str, constructor: yaml.SafeLoader, where: dict) -> Any:
    if isinstance(node, yaml.MappingNode):
        constructor.flatten_mapping(node)  # resolves YAML `<<:` merge keys in place
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            key = constructor.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise ValueError(f"{label}:{line}: {format_path(path)}: keys must be strings, got {key!r}")
            if key in out:
                raise ValueError(f"{label}:{line}: duplicate key '{format_path(path + (key,))}'")
            where[path + (key,)] = f"{label}:{line}"
            out[key] = _walk(value_node, path + (key,), label, constructor, where)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item_node in enumerate(node.value):
            where[path + (index,)] = f"{label}:{item_node.start_mark.line + 1}"
            items.append(_walk(item_node, path + (index,), label, constructor, where))
        return items
    return constructor.construct_object(node, deep=True)


def read_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> Layer:
    """Read a recipe and, recursively, the recipes it `extends:` (paths relative to the file).

    `extends` may be one path or a list; bases merge in order, then this file on top.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe not found: {path}")
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in _chain + (resolved,))
        raise ValueError(f"{path}: `extends` cycle: {cycle}")
    layer = read_yaml_layer(path)
    if "extends" not in layer.data:
        return layer
    origin = layer.where[("extends",)]
    bases = layer.data.pop("extends")
    layer.where = {k: v for k, v in layer.where.items() if k[0] != "extends"}
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) for b in bases):
        raise ValueError(f"{origin}: extends: expected a recipe path or a list of paths, got {bases!r}")
    merged = Layer()
    for base in bases:
        base_path = Path(os.path.normpath(path.parent / base))
        if not base_path.is_file():
            raise FileNotFoundError(f"{origin}: extends: {base} not found (looked at {base_path})")
        merged = merge_layers(merged, read_recipe(base_path, _chain + (resolved,)))
    return merge_layers(merged, layer)


# --------------------------------------------------------------------------- merging


def merge_layers(base: Layer, top: Layer) -> Layer:
    """Deep-merge `top` over `base`: mappings merge key by key, anything else is replaced."""
    where = dict(base.where)
    data = _merge(base.data, top.data, (), where)
    where.update(top.where)
    return Layer(data, where)


def _merge(base: dict, top: dict, path: KeyPath, where: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        sub = path + (key,)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, sub, where)
            continue
        # A replaced value's old children (list items, keys) no longer exist: forget where they were.
        for old in [p for p in where if len(p) > len(sub) and p[: len(sub)] == sub]:
            del where[old]
        out[key] = value
    return out


# --------------------------------------------------------------------------- command line


def parse_overrides(tokens: list[str], keeps_text: Callable[[KeyPath], bool] | None = None) -> list[Layer]:
    """Turn `--a.b=v` / `--a.b v` tokens into one Layer per override, in order.

    Values are parsed as YAML scalars or flow collections (`[0.9, 0.95]`, `{x: 1}`,
    `null`). `keeps_text(path)` says a field only takes strings, so `--name 123`
    means the string "123", not the int.
    """
    layers = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(f"command line: expected --section.key=VALUE or --section.key VALUE, got {token!r}")
        body = token[2:]
        if "=" in body:
            key, text = body.split("=", 1)
            shown, index = token, index + 1
        else:
            key = body
            if index + 1 >= len(tokens) or tokens[index + 1].startswith("--"):
                raise ValueError(f"command line: {token} needs a value (--{key}=VALUE or --{key} VALUE)")
            text = tokens[index + 1]
            shown, index = f"{token} {text}", index + 2
        path = tuple(key.split("."))
        if any(not part for part in path):
            raise ValueError(f"command line ({shown}): malformed key {key!r}")
        if path[0] == "extends":
            raise ValueError(f"command line ({shown}): `extends` is only allowed at the top of a recipe file")
        value = _parse_value(text, shown)
        if keeps_text is not None and isinstance(value, (bool, int, float)) and keeps_text(path):
            value = text
        data: Any = value
        for part in reversed(path):
            data = {part: data}
        origin = f"command line ({shown})"
        where = {path[:n]: origin for n in range(1, len(path) + 1)}
        # Children of a collection value (e.g. list items) point at the same override.
        _mark_children(value, path, origin, where)
        layers.append(Layer(data, where))
    return layers


def _parse_value(text: str, shown: str) -> Any:
    """`yaml.safe_load(text)` without aliases and with nesting bounded, as in a recipe file."""
    loader = _PlainLoader(text, "command-line value")
    try:
        return loader.get_single_data()
    except _Refused as exc:
        raise ValueError(f"command line ({shown}): {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"command line ({shown}): cannot parse value {text!r}: {exc}") from None
    finally:
        loader.dispose()


def _mark_children(value: Any, path: KeyPath, origin: str, where: dict) -> None:
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        where[path + (key,)] = origin
        _mark_children(child, path + (key,), origin, where)
