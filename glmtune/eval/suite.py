"""The suite file: test sets with their scorers, decoding, tools, general text and release gates.

    name: support-json            # required
    version: "1"                  # required; recorded in the scorecard and the release manifest
    system_prompt: null           # null: each row's own system turn; a string replaces it for every model
    enable_thinking: false        # the chat template's thinking switch for every prompt
    decoding: {max_new_tokens: 96, temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0,
               stop_strings: [], max_tool_rounds: 2, batch_size: 8}
    tools: {timeout_s: 10, functions: {lookup_order: "glmtune.data.synthetic:lookup_order"}}
    sets:
      - name: tickets
        run_split: validation     # or path: file.jsonl (relative to this file)
        limit: 24
        scorers: [{type: task_success, fields: [product]}, {type: format, schema: s.json}, tool_execution]
    general_text: {path: general.txt, max_tokens: 2048, window: 512}
    domain_text: {path: heldout.jsonl, window: 512}   # held-out domain documents (domain_text.py)
    gates:
      - {metric: tickets/task_success/exact, rule: improves}

Loading is strict (docs/eval.md is the reference): unknown keys and wrong types are errors
naming the file:line and key (the typed conversion of `glmtune.config.loader`), every scorer's
options are typed the same way, schema files and regular expressions are read here, and every
gate's metric id must be one the suite produces. Every number must be finite and within the
bounds below (a typo such as `max_new_tokens: 1000000000000` would otherwise size a decode cache
or a wait), and the suite and set names become directory and file names (`DIR/sets/<set>.jsonl`,
`CAND/eval/<suite>`), so they must be names, not paths (`io.text_limits.safe_name`). Nothing
runs before the whole file is valid.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from glmtune.config.loader import Converter, resolve_recipe_path
from glmtune.config.yaml_layers import format_path, read_yaml_layer
from glmtune.eval.domain_text import DOMAIN_METRICS, MAX_DOMAIN_DOCUMENTS, METRIC_PREFIX, DomainTextConfig
from glmtune.eval.general_text import GENERAL_TEXT_METRIC
from glmtune.eval.operations import OPERATIONS_METRICS
from glmtune.eval.scorers import SCORERS, MetricDef
from glmtune.io.regular import open_regular
from glmtune.io.text_limits import safe_name

RESERVED_SETS = ("general_text", "operations", "domain_text")  # metric-id prefixes the suite itself produces
_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# Bounds of the suite's numbers, inclusive. Past them a value is a typo, or would exhaust memory
# or time (the decode cache is sized by max_new_tokens; a timeout of inf never fires).
MAX_SUITE_BYTES = 1 << 20  # the suite file itself
MAX_NEW_TOKENS = 32_768
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # above any vocabulary
MAX_SEED = 2**32 - 1  # per-batch seeds derive from it and stay below 2**63
MAX_TOOL_ROUNDS = 16
MAX_BATCH_SIZE = 1024
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 32, 256
MAX_TIMEOUT_S = 3600.0
MAX_SET_ROWS = 100_000  # rows a set evaluates: its limit, and the rows read from a set without one
MAX_GENERAL_TEXT_TOKENS = 262_144
MAX_WINDOW = 32_768
MAX_THRESHOLD = 1e9  # |threshold|; a ratio metric's threshold is a fraction, |t| <= 1


@dataclass
class DecodingConfig:
    max_new_tokens: int = 128  # per generation round
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int = 0  # sampling seed (each batch and round derives its own from it)
    stop_strings: list[str] = field(default_factory=list)
    max_tool_rounds: int = 2  # tool-call rounds a request may take before its answer
    batch_size: int = 8  # prompts decoded together (left-padded)


@dataclass
class ToolsConfig:
    timeout_s: float = 10.0  # per call; a call running longer is killed and counts as failed
    functions: dict[str, str] = field(default_factory=dict)  # tool name -> "module:function"


@dataclass
class SetConfig:
    name: str = ""
    path: str | None = None  # JSONL, relative to the suite file
    run_split: Literal["validation"] | None = None  # the candidate run directory's held-out split
    limit: int | None = None  # the first N rows
    scorers: list[Any] = field(default_factory=list)  # "type" or {type: ..., options...}


@dataclass
class GeneralTextConfig:
    path: str = ""  # plain UTF-8 text, relative to the suite file
    max_tokens: int = 4096  # the first N tokens are scored
    window: int = 512  # tokens per forward (non-overlapping windows)


@dataclass
class GateConfig:
    metric: str = ""  # "<set>/<scorer>/<name>"
    rule: Literal["improves", "no_regression", "min", "max", "max_increase", "max_ratio_to_base"] = "improves"
    name: str | None = None  # shown in reports; default: metric, rule and threshold
    threshold: float | None = None  # a margin for improves and no_regression (default 0); required otherwise
    category: str = "all"
    model: str | None = None  # a candidate label ("candidate", "candidate-merged"); null: every candidate


@dataclass
class SuiteFile:
    name: str | None = None
    version: str | int | None = None
    description: str = ""
    system_prompt: str | None = None
    enable_thinking: bool = False
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    sets: list[SetConfig] = field(default_factory=list)
    general_text: GeneralTextConfig | None = None
    domain_text: DomainTextConfig | None = None  # held-out domain documents, scored as loss and perplexity
    gates: list[GateConfig] = field(default_factory=list)


@dataclass
class EvalSet:
    name: str
    path: Path | None  # resolved; None for run_split
    run_split: str | None
    limit: int | None
    scorers: list[Any]  # scorer instances, in file order
    where: str  # file:line of the set

    @property
    def row_kind(self) -> str:
        """The kind of row the set holds, its scorers' (one kind per set, checked at load)."""
        return "preference" if any(scorer.row_kind == "preference" for scorer in self.scorers) else "chat"


@dataclass
class Suite:
    path: Path
    data: bytes  # the file's bytes
    sha256: str
    file: SuiteFile
    sets: list[EvalSet]
    metrics: dict[str, MetricDef]  # metric id -> definition, every metric the suite produces
    general_text_path: Path | None
    domain_text_path: Path | None = None  # resolved `domain_text.path`

    @property
    def name(self) -> str:
        return str(self.file.name)

    @property
    def version(self) -> str:
        return str(self.file.version)

    @property
    def dir(self) -> Path:
        return self.path.parent


class _Errors:
    def __init__(self, where: dict, label: str) -> None:
        self.where, self.label, self.items = where, label, []

    def locate(self, path: tuple) -> str:
        """file:line of the innermost key of `path` the file holds (else the file)."""
        return next((self.where[path[:n]] for n in range(len(path), 0, -1) if path[:n] in self.where), self.label)

    def at(self, path: tuple, message: str) -> None:
        self.items.append(f"{self.locate(path)}: {format_path(path)}: {message}")

    def name(self, path: tuple, value: object) -> bool:
        """Whether `value` can be a file name (`safe_name`); else an error at `path`."""
        try:
            safe_name(value, format_path(path))
        except ValueError as exc:
            self.items.append(f"{self.locate(path)}: {exc}")
            return False
        return True

    def in_range(self, path: tuple, value: float, low: float, high: float, *, above_low: bool = False) -> None:
        """An error at `path` unless `value` is finite and in [low, high] ((low, high] with above_low)."""
        if math.isfinite(value) and (value > low if above_low else value >= low) and value <= high:
            return
        rule = f"{'>' if above_low else '>='} {low:g} and <= {high:g}"
        if isinstance(low, int) and isinstance(high, int):
            rule = f">= {low} and <= {high}"
        self.at(path, f"must be {rule}, got {value!r}")

    def raise_if_any(self) -> None:
        if len(self.items) == 1:
            raise ValueError(self.items[0])
        if self.items:
            raise ValueError(f"{len(self.items)} suite errors:\n  " + "\n  ".join(self.items))


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file (a path, or a name under recipes/ as `glmtune train` takes)."""
    path = resolve_recipe_path(path).resolve()
    if path.is_file() and path.stat().st_size > MAX_SUITE_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes, more than the {MAX_SUITE_BYTES:,} a suite file "
                         "may have (MAX_SUITE_BYTES); the rows belong in set files")
    with open_regular(path, "suite") as f:  # a FIFO would block the read
        data = f.read()  # hashed and copied into the eval directory as read
    layer = read_yaml_layer(path, kind="suite")
    label = str(path)
    converter = Converter(layer.where, label)
    file = converter.dataclass(layer.data, SuiteFile, ())
    errors = _Errors(layer.where, label)
    errors.items += converter.errors
    errors.raise_if_any()  # the checks below read typed values
    for key in ("name", "version"):
        if getattr(file, key) in (None, ""):
            errors.at((key,), "required")
    if file.name not in (None, ""):
        errors.name(("name",), file.name)  # the default output directory is CAND/eval/<name>
    _check_decoding(file.decoding, errors)
    _check_tools(file.tools, errors)
    sets = _build_sets(file, path.parent, converter, errors)
    general_path = None
    if file.general_text is not None:
        general_path = path.parent / file.general_text.path
        if not file.general_text.path or not general_path.is_file():
            errors.at(("general_text", "path"), f"file not found: {general_path}")
        errors.in_range(("general_text", "max_tokens"), file.general_text.max_tokens, 2, MAX_GENERAL_TEXT_TOKENS)
        errors.in_range(("general_text", "window"), file.general_text.window, 2, MAX_WINDOW)
    metrics = {f"{s.name}/{scorer.name}/{m.name}": m for s in sets for scorer in s.scorers
               for m in scorer.metrics(scorer.options)}
    metrics.update({f"operations/{group}/{m.name}": m for group, m in OPERATIONS_METRICS})
    if file.general_text is not None:
        metrics["general_text/loss/loss"] = GENERAL_TEXT_METRIC
    domain_path = _check_domain_text(file.domain_text, path.parent, errors)
    if domain_path is not None:
        metrics.update({f"{METRIC_PREFIX}/{m.name}": m for m in DOMAIN_METRICS})
    _check_gates(file.gates, metrics, errors)
    errors.raise_if_any()
    return Suite(path, data, hashlib.sha256(data).hexdigest(), file, sets, metrics, general_path, domain_path)


def _check_domain_text(domain: DomainTextConfig | None, suite_dir: Path, errors: _Errors) -> Path | None:
    """The domain set's resolved path (None without one), its keys checked (`domain_text.py`)."""
    if domain is None:
        return None
    path = suite_dir / domain.path
    if not domain.path or not path.exists():
        errors.at(("domain_text", "path"), f"file not found: {path}")
    errors.in_range(("domain_text", "window"), domain.window, 2, MAX_WINDOW)
    if domain.limit is not None:
        errors.in_range(("domain_text", "limit"), domain.limit, 1, MAX_DOMAIN_DOCUMENTS)
    if not domain.text_field:
        errors.at(("domain_text", "text_field"), "a field name is required")
    for key in ("source_field", "text_separator"):  # null: the file is the source / one document per file
        if getattr(domain, key) == "":
            errors.at(("domain_text", key), "empty; give a value or null")
    return path


def _check_decoding(d: DecodingConfig, errors: _Errors) -> None:
    for key, low, high in (("max_new_tokens", 1, MAX_NEW_TOKENS), ("temperature", 0.0, MAX_TEMPERATURE),
                           ("top_k", 0, MAX_TOP_K), ("seed", 0, MAX_SEED), ("max_tool_rounds", 0, MAX_TOOL_ROUNDS),
                           ("batch_size", 1, MAX_BATCH_SIZE)):
        errors.in_range(("decoding", key), getattr(d, key), low, high)
    errors.in_range(("decoding", "top_p"), d.top_p, 0.0, 1.0, above_low=True)
    if len(d.stop_strings) > MAX_STOP_STRINGS:
        errors.at(("decoding", "stop_strings"), f"{len(d.stop_strings)} stop strings, more than {MAX_STOP_STRINGS}")
    for i, stop in enumerate(d.stop_strings):
        if not stop:
            errors.at(("decoding", "stop_strings", i), "an empty stop string would stop at once")
        elif len(stop) > MAX_STOP_STRING_CHARS:
            errors.at(("decoding", "stop_strings", i), f"{len(stop)} characters, more than {MAX_STOP_STRING_CHARS}")


def _check_tools(tools: ToolsConfig, errors: _Errors) -> None:
    errors.in_range(("tools", "timeout_s"), tools.timeout_s, 0.0, MAX_TIMEOUT_S, above_low=True)
    for name, ref in tools.functions.items():
        if not _FUNCTION_REF.match(ref):
            errors.at(("tools", "functions", name),
                      f"expected 'module:function' (e.g. mypkg.tools:lookup), got {ref!r}")


def _build_sets(file: SuiteFile, suite_dir: Path, converter: Converter, errors: _Errors) -> list[EvalSet]:
    if not file.sets and file.domain_text is None:  # a continued-pretraining suite may score text alone
        errors.at(("sets",), "at least one set (or a domain_text set) is required")
    sets, seen = [], set()
    for i, s in enumerate(file.sets):
        where = ("sets", i)
        named = errors.name(where + ("name",), s.name)  # DIR/sets/<name>.jsonl
        if named and not _SET_NAME.match(s.name):
            errors.at(where + ("name",), f"a set needs a name of letters, digits, '_', '-', '.', got {s.name!r}")
        elif named and (s.name in RESERVED_SETS or s.name in seen):
            errors.at(where + ("name",), f"{s.name!r} is {'reserved' if s.name in RESERVED_SETS else 'used twice'}")
        seen.add(s.name)
        if (s.path is None) == (s.run_split is None):
            errors.at(where, "give exactly one of path (a JSONL file) and run_split: validation")
        path = suite_dir / s.path if s.path is not None else None
        if path is not None and not path.is_file():
            errors.at(where + ("path",), f"file not found: {path}")
        if s.limit is not None:
            errors.in_range(where + ("limit",), s.limit, 1, MAX_SET_ROWS)
        if not s.scorers:
            errors.at(where + ("scorers",), "at least one scorer is required")
        scorers, names = [], set()
        for j, entry in enumerate(s.scorers):
            scorer = _build_scorer(entry, where + ("scorers", j), suite_dir, converter, errors)
            if scorer is not None and scorer.name in names:
                errors.at(where + ("scorers", j), f"scorer {scorer.name} appears twice in set {s.name}")
            elif scorer is not None:
                names.add(scorer.name)
                scorers.append(scorer)
        _check_row_kinds(scorers, where, s.name, errors)
        sets.append(EvalSet(s.name, path, s.run_split, s.limit, scorers, errors.where.get(where, errors.label)))
    return sets


def _check_row_kinds(scorers: list[Any], where: tuple, set_name: str, errors: _Errors) -> None:
    """A set's scorers all read one kind of row: chat rows answered by generation, or preference
    pairs scored teacher-forced (the `preference` scorer)."""
    pairs = [scorer.name for scorer in scorers if scorer.row_kind == "preference"]
    chat = [scorer.name for scorer in scorers if scorer.row_kind == "chat"]
    if pairs and chat:
        errors.at(where + ("scorers",), f"set {set_name}: {', '.join(pairs)} scores preference pairs "
                  f"(prompt/chosen/rejected) and {', '.join(chat)} score generated answers to chat rows; "
                  "a set holds one kind of row: put them in two sets")


def _build_scorer(entry: Any, path: tuple, suite_dir: Path, converter: Converter, errors: _Errors):
    options = {} if isinstance(entry, str) else dict(entry) if isinstance(entry, dict) else None
    kind = entry if isinstance(entry, str) else options.pop("type", None) if options is not None else None
    if kind not in SCORERS:
        errors.at(path, f"a scorer is a name or a mapping with type: one of {', '.join(SCORERS)}; got {entry!r}")
        return None
    cls = SCORERS[kind]
    before = len(converter.errors)
    typed = converter.dataclass(options, cls.Options, path)
    if len(converter.errors) > before:
        errors.items += converter.errors[before:]
        return None
    try:
        return cls(typed, suite_dir)
    except (ValueError, OSError) as exc:
        errors.at(path, str(exc))
        return None


def _check_gates(gates: list[GateConfig], metrics: dict[str, MetricDef], errors: _Errors) -> None:
    for i, gate in enumerate(gates):
        where = ("gates", i)
        if gate.metric not in metrics:
            close = [m for m in metrics if m.split("/")[-1] == gate.metric.split("/")[-1]]
            hint = f" (did you mean {close[0]}?)" if close else f"; the suite's metrics: {', '.join(sorted(metrics))}"
            errors.at(where + ("metric",), f"unknown metric {gate.metric!r}{hint}")
        if gate.metric in metrics and metrics[gate.metric].candidate_only and gate.rule not in ("min", "max"):
            errors.at(where + ("rule",), f"{gate.metric} is measured against the base (the base has no value of "
                      f"its own), so rule {gate.rule} has nothing to compare; use min or max with a threshold")
        if gate.rule in ("min", "max", "max_increase", "max_ratio_to_base") and gate.threshold is None:
            errors.at(where + ("threshold",), f"rule {gate.rule} needs a threshold")
        if gate.threshold is not None:
            ratio = gate.metric in metrics and metrics[gate.metric].unit == "ratio"
            bound = 1.0 if ratio else MAX_THRESHOLD  # a ratio's 75% is 0.75: 75 would be a typo
            low = 0.0 if gate.rule in ("improves", "no_regression") else -bound  # a margin
            multiple = gate.rule == "max_ratio_to_base"  # a multiple of the base (> 0), whatever the metric's unit
            if multiple:
                low, bound = 0.0, MAX_THRESHOLD
            errors.in_range(where + ("threshold",), gate.threshold, low, bound, above_low=multiple)
        if gate.model is not None and gate.model not in ("candidate", "candidate-merged"):
            errors.at(where + ("model",), f"must be candidate or candidate-merged, got {gate.model!r}")
