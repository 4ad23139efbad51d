"""What the decide tests share: the CLI in this process, small suites of the bundled task, the run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import yaml

from glmtune.cli import main
from glmtune.data.synthetic import SCHEMA_PATH
from tests.train.run_helpers import WITH_EXPORT, shared_run

BUNDLED = Path(__file__).resolve().parents[2] / "recipes" / "tiny"


def trained_run(shared_results) -> Path:
    """The shared four-step tiny run with its HF export (also eval's tests' run): base/ and hf/."""
    return shared_run(shared_results, *WITH_EXPORT).run_dir


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`glmtune ARGV` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_suite(directory: Path, sets: list[dict], gates: list[dict], max_new_tokens: int = 8) -> Path:
    """A suite file of these sets and gates, the bundled task's tool and a short decoding."""
    suite = {"name": "decide-ci", "version": "1",
             "decoding": {"max_new_tokens": max_new_tokens, "batch_size": 8, "max_tool_rounds": 1},
             "tools": {"timeout_s": 30, "functions": {"lookup_order": "glmtune.data.synthetic:lookup_order"}},
             "sets": sets, "gates": gates}
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


TICKET_SCORERS = [{"type": "task_success", "fields": ["product", "severity", "next_action"]},
                  {"type": "format", "schema": str(SCHEMA_PATH), "critical": "schema"}]


def decision_of(out: Path) -> dict:
    return json.loads((out / "decision.json").read_text())


def metric(decision: dict, metric_id: str) -> dict:
    """label -> value of a metric (category all)."""
    found = next(m for m in decision["scorecard"]["metrics"] if m["id"] == metric_id)
    return found["by_category"]["all"]["values"]
