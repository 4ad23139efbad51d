"""tool_execution: the model's tool calls, executed, do what the reference's calls do.

Scored by execution, not by text resemblance. The evaluation loop has already parsed each call
the model made, checked its arguments against the row's tool schema and run the registered
Python function (`tools.py`); the reference's calls were run through the same functions once
before any model (`EvalRow.reference_results`). A row succeeds when

  * the reference calls tools: the model made the same number of calls, and each one names the
    same function, has valid arguments, ran without error, and returned exactly the result of
    the reference call at that position (so `ORD-123` and `ord-123 ` count as equal only if
    the function says so);
  * the reference calls none: the model made no call (a spurious call fails the row).

Metrics: `success` (ratio over rows), `spurious_calls` (calls on rows whose reference makes
none) and `failed_calls` (calls that did not parse, had invalid arguments, or raised / timed out).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, short


class ToolExecution:
    name = "tool_execution"
    row_kind = "chat"  # the rows it scores: chat rows, answered by generation

    @dataclass
    class Options:
        pass

    def __init__(self, options: "ToolExecution.Options", suite_dir: Path) -> None:
        self.options = options

    @staticmethod
    def metrics(options: "ToolExecution.Options") -> list[MetricDef]:
        return [MetricDef("success", "the right tool calls, executed, give the reference calls' results "
                                     "(no call where the reference makes none)", "ratio", True),
                MetricDef("spurious_calls", "tool calls on rows whose reference makes none", "count", False, "sum"),
                MetricDef("failed_calls", "tool calls that did not parse, had invalid arguments or failed to run",
                          "count", False, "sum")]

    def check_row(self, row: EvalRow) -> list[str]:
        return [f"the reference call to {result.name} fails: {result.error}"
                for result in row.reference_results if not result.ok]

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        calls = output.tool_calls
        failed = sum(not call.ok for call in calls)
        failures = [f"{call.name or '(no name)'}: {call.error}" for call in calls if not call.ok]
        spurious = 0
        if not row.reference_calls:
            spurious = len(calls)
            if calls:
                failures.insert(0, f"spurious call to {calls[0].name or '(no name)'} (the reference makes none)")
        elif len(calls) != len(row.reference_calls):
            names = ", ".join(c["name"] for c in row.reference_calls)
            failures.insert(0, f"made {len(calls)} tool call(s), the reference {len(row.reference_calls)} ({names})")
        else:
            for call, want in zip(calls, row.reference_results):
                if call.name != want.name:
                    failures.append(f"called {call.name}, want {want.name}")
                elif call.ok and call.result != want.result:
                    failures.append(f"{call.name} returned {short(call.result)}, the reference call "
                                    f"{short(want.result)}")
        return RowScore({"success": float(not failures), "spurious_calls": float(spurious),
                         "failed_calls": float(failed)}, failures)
