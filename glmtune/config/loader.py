"""Load a `JobConfig` from a recipe plus overrides, and write the resolved config back out.

    cfg = load_config("recipes/tiny/sft_support_json.yaml", ["--optim.lr=3e-4"])
    dump_config(cfg, run_dir / "config.yaml")       # reloads to an equal JobConfig

Conversion is strict: unknown keys and wrong types are `ValueError`s naming the key
path, the expected type, the value, and the file:line (or command-line flag) it came
from, with a "did you mean" for misspelt keys; a key that was removed (`REMOVED_KEYS`)
says why and that the line goes. All problems are reported at once.
Two leniencies, both for YAML 1.1's sake: an int is accepted for a float, and so is a
numeric string, because YAML 1.1 reads `2e-5` (no dot) as a string. Numbers are
finite: YAML's `.nan`/`.inf` (or `1e999`) in any field, free-form values included, and
an int beyond 64 bits are refused here, with the line; ranges are `validate.py`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from glmtune.config.schema import JobConfig, OptimConfig, TrainConfig
from glmtune.config.yaml_layers import KeyPath, Layer, format_path, merge_layers, parse_overrides, read_recipe
from glmtune.io.regular import check_regular_file

# Recipes shipped in the source tree (`pip install -e .`); lets `glmtune config show
# tiny/sft_support_json` work from any directory.
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"

_FLOAT_MAX = sys.float_info.max
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_YAML_BOOL_WORDS = "yes/no/on/off/true/false"

# Keys that had one working value and were removed (issue 29), one row each: (section class,
# key) -> why, and the values it could only ever have held. A recipe that still sets one is
# refused with the reason, at its file:line, rather than as an unknown key; a run's saved
# config.yaml from before the removal, holding one of those values, loads without it.
@dataclasses.dataclass(frozen=True)
class RemovedKey:
    why: str
    former_values: tuple[Any, ...]


REMOVED_KEYS: dict[tuple[type, str], RemovedKey] = {
    (TrainConfig, "autocast"): RemovedKey("glmtune computes in model.dtype (bf16 under fp32 master weights) "
                                          "without torch.autocast", ("auto", "none")),
    (OptimConfig, "name"): RemovedKey("the optimizer is always AdamW (optim.fused picks its kernel)", ("adamw",)),
}


def resolve_recipe_path(name: str | Path) -> Path:
    """An existing file as given, else `recipes/<name>` or `recipes/<name>.yaml`."""
    path = Path(name)
    if path.is_file():
        return path
    if path.exists() and not path.is_dir():  # a FIFO or a device: refused, not looked up under recipes/
        return check_regular_file(path, "recipe")
    for candidate in (RECIPES_DIR / path, RECIPES_DIR / f"{path}.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"recipe not found: {name} (also looked in {RECIPES_DIR})")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Recipe file (following `extends:`) + dotted overrides -> type-checked JobConfig.

    `path=None` starts from the schema defaults. Cross-field checks (parallel degrees,
    batch divisibility) are `validate.validate_config`'s job, not this function's.
    """
    layer = read_recipe(resolve_recipe_path(path)) if path is not None else Layer()
    for override in parse_overrides(list(overrides), keeps_text=_takes_only_text):
        layer = merge_layers(layer, override)
    return _build(layer, default_where=str(path) if path is not None else "command line")


# A removed key's values that meant nothing: what a run's saved config.yaml records for it.
def load_run_config(path: str | Path) -> JobConfig:
    """A run's saved `config.yaml`, written by an earlier glmtune too: a removed key that holds
    a value it could only ever have had (`RemovedKey.former_values`) is dropped, any other is
    refused as in a recipe (so a run that trained with a setting glmtune no longer has says so)."""
    layer = read_recipe(Path(path))
    sections = {section: name for name, section in typing.get_type_hints(JobConfig).items()}
    for (owner, key), removed in REMOVED_KEYS.items():
        fields = layer.data.get(sections.get(owner, ""))
        if isinstance(fields, dict) and key in fields and any(
                fields[key] == v and type(fields[key]) is type(v) for v in removed.former_values):
            del fields[key]
    return _build(layer, default_where=str(path))


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> JobConfig:
    """Convert an already-parsed mapping (e.g. a checkpoint's saved config) with the same checks."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a config must be a mapping of sections, got {type(data).__name__}")
    return _build(Layer(data, {}), default_where=source)


def config_to_dict(cfg: Any) -> Any:
    """A dataclass tree as plain dicts/lists/scalars, in field order (YAML- and JSON-safe)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of numbers (`betas: [0.9, 0.999]`) which read better inline."""

    def represent_list(self, data: list) -> yaml.Node:
        numeric = bool(data) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=numeric)


_Dumper.add_representer(list, _Dumper.represent_list)


def config_to_yaml(cfg: JobConfig) -> str:
    # A wide line limit keeps descriptions and paths on one line each.
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=4096)


def dump_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the resolved config; `load_config(path)` gives back an equal JobConfig."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Resolved glmtune config of run '{cfg.name}'; a recipe in its own right (glmtune config show FILE).\n"
    tmp = path.with_name(f".{path.name}.tmp")  # a killed run never leaves half a config
    tmp.write_text(header + config_to_yaml(cfg), encoding="utf-8")
    tmp.replace(path)


def _build(layer: Layer, default_where: str) -> JobConfig:
    converter = Converter(layer.where, default_where, finite=True)
    cfg = converter.dataclass(layer.data, JobConfig, ())
    if converter.errors:
        if len(converter.errors) == 1:
            raise ValueError(converter.errors[0])
        raise ValueError(f"{len(converter.errors)} config errors:\n  " + "\n  ".join(converter.errors))
    _fill_run_paths(cfg)
    return cfg


def _fill_run_paths(cfg: JobConfig) -> None:
    # Filled at load time (after overrides, so `--name` moves them) so that the saved
    # config records where this run actually wrote its files.
    if cfg.logging.run_dir is None:
        cfg.logging.run_dir = f"runs/{cfg.name}"
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = f"{cfg.logging.run_dir}/checkpoints"


# --------------------------------------------------------------------------- typed conversion


class _Mismatch(Exception):
    """The value does not have the expected type; the caller records it with a location."""


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _describe(tp: Any) -> str:
    members = _union_members(tp)
    if members is not None:
        return " or ".join("null" if m is type(None) else _describe(m) for m in members)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"list of {_describe(args[0])}"
    if origin is tuple:
        if Ellipsis in args:
            return f"list of {_describe(args[0])}"
        return f"list of {len(args)} {_describe(args[0])} values"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return "any value" if tp is Any else tp.__name__


class Converter:
    """Walks a value and a type together; collects errors instead of stopping at the first.

    With `finite`, numbers must be finite and ints fit in 64 bits (`_check_finite`), as
    every JobConfig is loaded; other callers (eval suites) bound their numbers themselves.
    """

    def __init__(self, where: dict[KeyPath, str], default_where: str, finite: bool = False):
        self.where = where
        self.default_where = default_where
        self.finite = finite
        self.errors: list[str] = []

    def locate(self, path: KeyPath) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self.where:
                return self.where[path[:n]]
        return self.default_where

    def dataclass(self, value: Any, cls: type, path: KeyPath) -> Any:
        hints = _hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, item in value.items():
            if key not in hints:
                if (cls, key) in REMOVED_KEYS:
                    self._removed_key(path + (key,), REMOVED_KEYS[cls, key].why)
                else:
                    self._unknown_key(path, key, names)
                continue
            try:
                kwargs[key] = self.convert(item, hints[key], path + (key,))
            except _Mismatch as exc:
                self._type_error(path + (key,), hints[key], item, str(exc))
        return cls(**kwargs)

    def convert(self, value: Any, tp: Any, path: KeyPath) -> Any:
        """Return `value` as type `tp`, or raise `_Mismatch`; nested errors are recorded."""
        members = _union_members(tp)
        if members is not None:
            if value is None and type(None) in members:
                return None
            detail = ""  # why a member refused it, when it says (`nan` for `float | None`)
            for member in members:
                if member is type(None):
                    continue
                trial = Converter(self.where, self.default_where, self.finite)
                try:
                    result = trial.convert(value, member, path)
                except _Mismatch as exc:
                    detail = detail or str(exc)
                    continue
                self.errors.extend(trial.errors)
                return result
            raise _Mismatch(_bool_hint(value, members) or detail)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is Any:
            if self.finite and _has_non_finite(value):  # model.overrides: a NaN would reach the model as is
                raise _Mismatch("(NaN and infinity are not allowed in a config)")
            return value
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise _Mismatch()
            return self.dataclass(value, tp, path)
        if origin is Literal:
            # Compare types too: True == 1 in Python, but `true` is not a valid choice of 1.
            if any(value == a and type(value) is type(a) for a in args):
                return value
            raise _Mismatch(_bool_hint(value, (tp,)))
        if origin in (list, tuple):
            if not isinstance(value, list):
                raise _Mismatch()
            if origin is tuple and Ellipsis not in args and len(value) != len(args):
                raise _Mismatch(f"(needs exactly {len(args)} items)")
            item_types = [args[0]] * len(value) if origin is list or Ellipsis in args else list(args)
            out = [self._item(v, t, path + (i,)) for i, (v, t) in enumerate(zip(value, item_types))]
            return tuple(out) if origin is tuple else out
        if origin is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise _Mismatch()
            return {k: self._item(v, args[1], path + (k,)) for k, v in value.items()}
        result = _scalar(value, tp)
        if self.finite:
            _check_finite(result)
        return result

    def _item(self, value: Any, tp: Any, path: KeyPath) -> Any:
        try:
            return self.convert(value, tp, path)
        except _Mismatch as exc:
            self._type_error(path, tp, value, str(exc))
            return value

    def _unknown_key(self, path: KeyPath, key: str, names: list[str]) -> None:
        full = format_path(path + (key,))
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if close:
            hint = f" (did you mean '{format_path(path + (close[0],))}'?)"
        else:
            hint = f"; valid keys{' under ' + format_path(path) if path else ''}: {', '.join(names)}"
        self.errors.append(f"{self.locate(path + (key,))}: unknown key '{full}'{hint}")

    def _removed_key(self, path: KeyPath, why: str) -> None:
        where = self.locate(path)
        fix = "drop the flag" if where.startswith("command line") else "delete the line"
        self.errors.append(f"{where}: {format_path(path)} was removed: {why}; {fix}")

    def _type_error(self, path: KeyPath, tp: Any, value: Any, detail: str) -> None:
        shown = repr(value)
        if len(shown) > 80:  # a 400-digit number or a long list: the start is enough to find it
            shown = shown[:60] + f"... ({len(shown):,} characters)"
        expected = "" if tp is Any else f"expected {_describe(tp)}, "
        message = f"{self.locate(path)}: {format_path(path)}: {expected}got {shown}"
        self.errors.append(message + (f" {detail}" if detail else ""))


def _scalar(value: Any, tp: Any) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value) if abs(value) <= _FLOAT_MAX else math.inf  # float(10**400) raises
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)  # "1e999" is inf
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise AssertionError(f"schema uses unsupported type {tp!r}")
    raise _Mismatch()


def _check_finite(value: Any) -> None:
    """`_Mismatch` for a NaN or infinite float (YAML's .nan/.inf, or past the float range: no
    setting means them) and for an int past 64 bits (every count ends up in an int64)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _Mismatch("(a finite number is needed)")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise _Mismatch("(out of the 64-bit range)")


def _has_non_finite(value: Any) -> bool:
    """Whether a float NaN or infinity is anywhere in `value` (nesting is bounded by the YAML reader)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def _bool_hint(value: Any, members: tuple[Any, ...]) -> str:
    # `off`, `no`, `on` unquoted are booleans in YAML 1.1: say so when a choice was expected.
    wants_text = any(typing.get_origin(m) is Literal for m in members)
    if isinstance(value, bool) and wants_text:
        return f"(YAML reads unquoted {_YAML_BOOL_WORDS} as booleans; quote the value)"
    return ""


def _takes_only_text(path: KeyPath) -> bool:
    """Whether the field at `path` accepts strings but no bool/int/float (for CLI values)."""
    tp: Any = JobConfig
    for part in path:
        members = _union_members(tp)
        if members is not None:
            non_null = [m for m in members if m is not type(None)]
            if len(non_null) != 1:
                return False
            tp = non_null[0]
        if dataclasses.is_dataclass(tp):
            tp = _hints(tp).get(part)
            if tp is None:
                return False
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return False
    accepted = set(_union_members(tp) or (tp,))
    return str in accepted and not accepted & {bool, int, float}
