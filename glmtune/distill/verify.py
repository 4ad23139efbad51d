"""`--keep-if SUITE`: a teacher answer is kept only when it passes the suite's format scorers.

Every `format` scorer of the suite's sets (deduplicated by its options: the JSON Schema file and
what counts as critical) scores the answer as `glmtune eval` would (its `critical_failures` must
be 0: the answer parses as JSON and, with a schema, validates). A suite with no `format` scorer is
refused. The suite's `tool_execution` scorers compare a model's executed calls with each eval row's
reference calls, which a teacher's prompt does not have: they are not applied, and `glmtune
distill generate` says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.eval.scorers.base import EvalRow, ModelOutput
from glmtune.eval.suite import load_suite


class Verifier:
    """The suite's format scorers as one pass/fail check (module docstring)."""

    def __init__(self, suite_path: str | Path) -> None:
        suite = load_suite(suite_path)
        self.suite_path, self.sha256 = suite.path, suite.sha256
        scorers, seen = [], set()
        for eval_set in suite.sets:
            for scorer in eval_set.scorers:
                key = (scorer.name, repr(scorer.options))
                if scorer.name == "format" and key not in seen:
                    seen.add(key)
                    scorers.append(scorer)
        if not scorers:
            raise ValueError(f"--keep-if {suite_path}: the suite has no format scorer to verify answers with")
        self.scorers = scorers
        self.unapplied = sorted({s.name for e in suite.sets for s in e.scorers if s.name == "tool_execution"})

    def failures(self, text: str, messages: list[dict[str, Any]], tools: list | None) -> list[str]:
        """Why the answer fails the scorers (empty: it passes)."""
        row = EvalRow("distill", "", "all", "", {}, messages, tools, None, [], [])
        output = ModelOutput(text, text, [], 0.0, 0, "answer")
        found: list[str] = []
        for scorer in self.scorers:
            score = scorer.score(row, output)
            if score.values.get("critical_failures"):
                found += score.failures or ["critical format failure"]
        return found
