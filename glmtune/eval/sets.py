"""A suite's test sets as evaluated rows: read, checked by the data contract, cut into prompts.

Rows are chat rows like training rows (JSONL or Parquet, `glmtune.data.sources`), each checked
by the data contract (every violation named file:line before any model loads) and normalized.
A `run_split: validation` set reads the candidate run directory's held-out split, the files its
data_manifest.json names, each looked up by its name in the run's data/ (never a path the manifest
leads elsewhere: data.validation's own files are given to a set by their path). `limit` keeps the
first N rows, and only those are read (and checked).
Reading is bounded: a set file over MAX_SET_FILE_BYTES is refused before it is opened, and a set
without a limit may hold at most `suite.MAX_SET_ROWS` rows (it is read no further).

A row is cut at its last user turn: the messages up to it are the prompt (with the suite's
`system_prompt`, when set, replacing any system turn), the assistant turns after it are the
reference: its tool calls (`reference_calls`) and its final content (`reference`). The category
is the row's `category` field, else "tool_call" when the reference calls a tool, else "other".
Each scorer then checks the rows it needs fields from (`check_row`).

A set of the `preference` scorer holds preference rows instead (prompt/chosen/rejected, checked by
the preference contract, `glmtune.data.preferences`): the prompt is the row's, chosen is the
reference, the category the row's `category` else "other"; nothing is generated for them. A row
of the other kind than the set's scorers read is refused at its file:line.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from glmtune.data.contract import check_or_raise
from glmtune.data.preferences import check_preferences_or_raise, row_kind
from glmtune.data.sources import Row, no_rows_message, read_rows
from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS
from glmtune.eval.models import ModelSource
from glmtune.eval.scorers.base import EvalRow
from glmtune.eval.suite import MAX_SET_ROWS, EvalSet, Suite
from glmtune.io.contained import inside
from glmtune.io.json_file import json_name, read_json_file
from glmtune.io.text_limits import clipped

MAX_SET_FILE_BYTES = 1 << 30  # one JSONL or Parquet file of a set
MAX_MANIFEST_BYTES = 64 << 20  # a run's data_manifest.json


@dataclass
class LoadedSet:
    spec: EvalSet
    source: str  # the file, or "run:validation"
    rows: list[EvalRow]
    jsonl: bytes  # the exact rows evaluated (DIR/sets/<name>.jsonl)
    files: list[Path]  # what was read


def _split_files(candidate: ModelSource, split: str) -> list[Path]:
    """The files of the run's `split` its data_manifest.json names, each found in the run's data/ by
    its name (a run directory that was moved keeps its data/ beside the manifest): a name read from
    the manifest never leads out of the run directory (`glmtune.io.contained`)."""
    if candidate.kind != "run":
        raise ValueError(f"run_split: {split} reads the candidate run directory's held-out split, but --candidate "
                         f"{candidate.source} is not a run directory; give the set a path")
    manifest_path = candidate.source / "data_manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"run_split: {split}: {manifest_path} not found (the run has not prepared its data)")
    manifest = read_json_file(manifest_path, f"run_split: {split}: data manifest", max_bytes=MAX_MANIFEST_BYTES)
    recorded = manifest.get(f"{split}_files")
    if recorded is None:
        raise ValueError(f"run_split: {split}: {manifest_path} names no {split} files (a run from before "
                         "glmtune eval); give the set a path to the split's JSONL")
    if not isinstance(recorded, list) or not all(isinstance(name, str) for name in recorded):
        raise ValueError(f"run_split: {split}: {manifest_path}: {split}_files is {json_name(recorded)}, not a list "
                         "of file names; not a data manifest glmtune writes")
    if not recorded:
        raise ValueError(f"run_split: {split}: the run {candidate.source} has no {split} split")
    data_dir = candidate.source / "data"
    files = [inside(data_dir, PurePosixPath(name).name, f"run_split: {split}: {manifest_path}: {split}_files")
             for name in recorded]
    for name, file in zip(recorded, files):
        if not file.is_file():
            raise ValueError(f"run_split: {split}: {manifest_path} names {clipped(name)}, which is not in {data_dir} "
                             "(a run's own split is written there; data.validation's files stay where they are): "
                             "give the set the file's path")
    return files


def _eval_row(spec: EvalSet, row: Row, index: int, system_prompt: str | None) -> EvalRow:
    data, origin = row.data, str(row.origin)
    messages = data["messages"]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError(f"{origin}: set {spec.name}: the row has no user turn to prompt with")
    prompt = messages[:last_user + 1]
    if system_prompt is not None:
        prompt = [{"role": "system", "content": system_prompt}] + [m for m in prompt if m["role"] != "system"]
    after = messages[last_user + 1:]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for m in after if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    final = after[-1] if after and after[-1]["role"] == "assistant" else None
    reference = final["content"] if final is not None and final["content"].strip() else None
    category = data.get("category")
    if not isinstance(category, str) or not category:
        category = "tool_call" if calls else "other"
    return EvalRow(spec.name, str(data.get("id") or f"{spec.name}-{index + 1}"), category, origin, data, prompt,
                   data.get("tools"), reference, calls, after)


def _eval_pair(spec: EvalSet, row: Row, index: int, system_prompt: str | None) -> EvalRow:
    """A preference row as an evaluated row: its prompt, chosen as the reference (scored with
    rejected, teacher-forced, by the preference scorer: the row's `data` keeps both)."""
    data = row.data
    prompt = data["prompt"]
    if system_prompt is not None:
        prompt = [{"role": "system", "content": system_prompt}] + [m for m in prompt if m["role"] != "system"]
    final = data["chosen"][-1]
    reference = final["content"] if final["role"] == "assistant" and final["content"].strip() else None
    category = data.get("category")
    category = category if isinstance(category, str) and category else "other"
    return EvalRow(spec.name, str(data.get("id") or f"{spec.name}-{index + 1}"), category, str(row.origin), data,
                   prompt, data.get("tools"), reference, [], data["chosen"])


def _check_kind(spec: EvalSet, rows: list[Row]) -> None:
    """The set's rows are the kind its scorers read (ValueError at the first row that is not)."""
    wanted = spec.row_kind
    for row in rows:
        kind = row_kind(row.data) if row.parse_error is None else wanted
        if kind == wanted:
            continue
        if wanted == "preference":
            raise ValueError(f"{row.origin}: <row>: a chat row (messages), but the preference scorer scores "
                             "preference rows (prompt/chosen/rejected); give the set a file of pairs")
        names = ", ".join(scorer.name for scorer in spec.scorers)
        raise ValueError(f"{row.origin}: <row>: a preference row (prompt/chosen/rejected), but {names} score "
                         "generated answers to chat rows (messages); score pairs with the preference scorer")


def _read_set(spec: EvalSet, files: list[Path], where: str, forbidden: tuple[str, ...]) -> list[Row]:
    """The set's first `limit` rows (at most MAX_SET_ROWS), checked by the data contract (no string
    holding a `forbidden` control token)."""
    for path in files:
        if path.is_file() and path.stat().st_size > MAX_SET_FILE_BYTES:
            raise ValueError(f"{where}: {path} is {path.stat().st_size:,} bytes, more than the {MAX_SET_FILE_BYTES:,} "
                             "a set file may have (MAX_SET_FILE_BYTES); split it or give the set a shorter file")
    wanted = spec.limit if spec.limit is not None else MAX_SET_ROWS
    try:
        rows = list(itertools.islice(read_rows(files), wanted + 1))  # one more: is there more than allowed?
        if len(rows) > wanted and spec.limit is None:
            raise ValueError(f"more than {MAX_SET_ROWS:,} rows, the most a set evaluates (MAX_SET_ROWS); give the "
                             "set a limit")
        _check_kind(spec, rows[:wanted])
        if spec.row_kind == "preference":
            return check_preferences_or_raise(rows[:wanted], control_tokens=forbidden)
        return check_or_raise(rows[:wanted], control_tokens=forbidden)
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_sets(suite: Suite, candidate: ModelSource,
              forbidden: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[LoadedSet]:
    """Every set's rows (ValueError: the first problems, each as file:line). `forbidden`: the control
    tokens of the template and tokenizer the prompts are rendered with (`chat_template.control_tokens`),
    which no string of a row may hold: it would forge a turn of the prompt."""
    loaded = []
    for spec in suite.sets:
        files = [spec.path] if spec.path is not None else _split_files(candidate, spec.run_split)
        where = f"{spec.where}: set {spec.name}"
        rows = _read_set(spec, files, where, forbidden)
        if not rows:
            raise ValueError(f"{where}: {no_rows_message(files)}")
        cut = _eval_pair if spec.row_kind == "preference" else _eval_row
        evaluated = [cut(spec, row, i, suite.file.system_prompt) for i, row in enumerate(rows)]
        jsonl = "".join(json.dumps(row.data, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        source = str(spec.path) if spec.path is not None else f"run:{spec.run_split}"
        loaded.append(LoadedSet(spec, source, evaluated, jsonl, files))
    return loaded


def check_rows(loaded: list[LoadedSet], max_shown: int = 10) -> None:
    """Every scorer's row requirements; one ValueError listing the first problems (file:line)."""
    problems = [f"{row.origin}: set {s.spec.name}: {scorer.name}: {reason}"
                for s in loaded for row in s.rows for scorer in s.spec.scorers for reason in scorer.check_row(row)]
    if problems:
        shown = "".join(f"\n  {p}" for p in problems[1:max_shown])
        more = f"\n  ... and {len(problems) - max_shown} more" if len(problems) > max_shown else ""
        raise ValueError(f"{len(problems)} row(s) the suite's scorers cannot score; the first: {problems[0]}"
                         f"{shown}{more}")


def tools_offered(loaded: list[LoadedSet]) -> list[dict[str, Any]]:
    """The distinct tool specs the evaluated rows offer, sorted by name (for the prompt hash)."""
    specs = {json.dumps(tool, sort_keys=True, ensure_ascii=False): tool
             for s in loaded for row in s.rows for tool in row.tools or []}
    return [specs[key] for key in sorted(specs)]
