"""The prompted arm's examples: k rows of the training data (`--examples DATA`), shown before each
prompt as earlier turns of the conversation.

`DATA` is a run directory (its training split: the file its data_manifest.json names as
`train_file`, found in the run's data/), or what `glmtune data validate` reads (JSONL, Parquet, a
folder of them, a `datasets` directory). At most MAX_POOL_ROWS rows are read (more is refused);
every row must pass the data contract (`glmtune.data.contract`, violations named file:line) and be
a chat row whose last user turn is answered. A row that shares a split key with a row of the eval
set (its `group`, else its `id`, else its content: `glmtune.data.split.split_key`, what the group
split keeps apart) is refused, naming both rows: examples come from training data, never from the
groups the suite evaluates.

How the k are chosen (`--shots-by`):
  * fixed: the first k rows of DATA, the same k before every prompt;
  * nearest: for each prompt, the k rows whose last user turn is nearest to the prompt's last user
    turn by BM25 (`retrieval.py`), the nearest first; when fewer than k share a word with it, the
    first rows of DATA fill the rest.
An example is shown as its turns without its system turn (user, assistant, tool calls and tool
results, the answer), after the prompt's system turn and before the prompt's own turns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from glmtune.data.contract import check_or_raise
from glmtune.data.preferences import row_kind
from glmtune.data.sources import Row, no_rows_message, read_rows
from glmtune.data.split import split_key
from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS
from glmtune.decide.retrieval import Bm25Index
from glmtune.io.contained import inside
from glmtune.io.json_file import read_json_file
from glmtune.io.text_limits import clipped

MAX_POOL_ROWS = 100_000
MAX_SHOTS = 32
SHOTS_BY = ("fixed", "nearest")
_MAX_MANIFEST_BYTES = 64 << 20


@dataclass
class Example:
    origin: str  # file:line
    turns: list[dict[str, Any]]  # the row's messages without system turns
    question: str  # its last user turn


class ExamplePool:
    """The rows examples are chosen from, and how (`choose`)."""

    def __init__(self, source: str, examples: list[Example], how: str) -> None:
        assert how in SHOTS_BY and examples
        self.source, self.examples, self.how = source, examples, how
        self.index = Bm25Index([e.question for e in examples]) if how == "nearest" else None

    def choose(self, question: str, k: int) -> list[Example]:
        if self.index is None:
            return self.examples[:k]
        chosen = [hit.index for hit in self.index.search(question, k)]
        chosen += [i for i in range(len(self.examples)) if i not in chosen][:k - len(chosen)]
        return [self.examples[i] for i in chosen]

    def describe(self, k: int) -> str:
        how = (f"the first {k} rows of {self.source}, the same before every prompt" if self.how == "fixed" else
               f"for each prompt, the {k} rows of {self.source} whose last user turn is nearest to the prompt's "
               "by BM25 (the first rows fill in when fewer share a word)")
        return f"{k} examples from {len(self.examples):,} training rows: {how}"


def _run_train_file(run_dir: Path) -> Path:
    """The training split a run directory wrote (data_manifest.json's train_file, in its data/)."""
    manifest_path = run_dir / "data_manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"--examples {run_dir}: a run directory without data_manifest.json (it has not prepared "
                         "its data); give the training data's files")
    manifest = read_json_file(manifest_path, "--examples: data manifest", max_bytes=_MAX_MANIFEST_BYTES)
    name = manifest.get("train_file")
    if not isinstance(name, str):
        raise ValueError(f"--examples {run_dir}: {manifest_path} names no train_file; give the training data's files")
    path = inside(run_dir / "data", PurePosixPath(name).name, f"--examples {manifest_path}: train_file")
    if not path.is_file():
        raise ValueError(f"--examples {run_dir}: {manifest_path} names {clipped(name)}, which is not in "
                         f"{run_dir / 'data'}; give the training data's files")
    return path


def _read_pool(arg: str | Path) -> tuple[str, list[Row]]:
    path = Path(arg)
    files = [_run_train_file(path)] if (path / "config.yaml").is_file() and path.is_dir() else [path]
    try:
        rows = list(itertools.islice(read_rows(files), MAX_POOL_ROWS + 1))
    except FileNotFoundError as exc:
        raise ValueError(f"--examples {arg}: {exc}") from None
    if len(rows) > MAX_POOL_ROWS:
        raise ValueError(f"--examples {arg}: more than {MAX_POOL_ROWS:,} rows (MAX_POOL_ROWS); give a sample of the "
                         "training data")
    if not rows:
        raise ValueError(f"--examples {arg}: {no_rows_message(files)}")
    return str(files[0]) if len(files) == 1 else str(arg), rows


def load_examples(arg: str | Path, eval_keys: dict[str, str], how: str = "fixed",
                  forbidden: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> ExamplePool:
    """The example pool of `--examples ARG` (module docstring); `eval_keys`: the split key of every
    evaluated row -> where it is (`eval_split_keys`). ValueError naming file:line for a row that
    breaks the contract (`forbidden`: the prompts' control tokens), is not a chat row, or shares the
    eval set's groups."""
    source, rows = _read_pool(arg)
    for row in rows:
        if row.parse_error is None and row_kind(row.data) == "preference":
            raise ValueError(f"--examples {row.origin}: a preference row (prompt/chosen/rejected); examples are chat "
                             "rows (messages), as SFT trains on")
    try:
        rows = check_or_raise(rows, control_tokens=forbidden)
    except ValueError as exc:
        raise ValueError(f"--examples: {exc}") from None
    examples = []
    for row in rows:
        key = split_key(row.data)
        if key in eval_keys:
            raise ValueError(f"--examples {row.origin}: {key.replace(':', ' ', 1)} is also in the eval set "
                             f"({eval_keys[key]}); examples come from the training data, never from the groups the "
                             "suite evaluates (pass the training split, e.g. a run directory)")
        turns = [m for m in row.data["messages"] if m["role"] != "system"]
        users = [i for i, m in enumerate(turns) if m["role"] == "user"]
        if not users or users[-1] == len(turns) - 1:
            raise ValueError(f"--examples {row.origin}: no answered user turn to show as an example")
        examples.append(Example(str(row.origin), turns, turns[users[-1]]["content"]))
    return ExamplePool(source, examples, how)


def eval_split_keys(loaded) -> dict[str, str]:
    """The split key of every row the suite evaluates -> "set NAME, FILE:LINE" (the first such row)."""
    keys: dict[str, str] = {}
    for s in loaded:
        for row in s.rows:
            keys.setdefault(split_key(row.data), f"set {s.spec.name}, {row.origin}")
    return keys


def with_examples(prompt: list[dict[str, Any]], examples: list[Example]) -> list[dict[str, Any]]:
    """`prompt` with the examples' turns after its system turn(s), before its own turns."""
    system = [m for m in prompt if m["role"] == "system"]
    rest = [m for m in prompt if m["role"] != "system"]
    return system + [turn for example in examples for turn in example.turns] + rest
