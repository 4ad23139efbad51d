"""What every scorer shares: the evaluated row, a model's output for it, metric definitions and
the per-row score a scorer returns.

A scorer is a class with
  * `row_kind`: the rows it scores: "chat" (answered by generation) or "preference" (pairs scored
    teacher-forced); a set's scorers share one kind;
  * `Options`: a dataclass of its suite-file options (typed, unknown keys are errors);
  * `metrics(options)`: the `MetricDef`s it reports (fixed per options, so a gate's metric id
    is checked when the suite loads);
  * `check_row(row)`: reasons a row cannot be scored (e.g. a refusal row without `must_refuse`),
    reported as file:line before any model runs;
  * `score(row, output)`: a `RowScore` for one model's output.
Metric values per category are the mean (ratios, seconds) or the sum (counts) of the row
values that are not None (`aggregate.py`). Answers are a model's output, so they are parsed with
their size and depth bounded (`parse_json`): a bad answer is a failed row, never an exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from glmtune.io import text_limits

MAX_ANSWER_BYTES = 4 << 20  # an answer parsed as JSON; far above what max_new_tokens can generate

Reduce = Literal["mean", "sum"]


@dataclass(frozen=True)
class MetricDef:
    name: str
    description: str
    unit: str  # "ratio" | "count" | "seconds" | "tokens_per_s" | "gib" | "nats_per_token" | "nats"
    higher_is_better: bool
    reduce: Reduce = "mean"
    candidate_only: bool = False  # measured against the base (the base's value is null): gates min/max only


@dataclass
class EvalRow:
    """One row of a test set, cut into what the models see and what they are scored against."""

    set: str
    id: str
    category: str
    origin: str  # file:line
    data: dict[str, Any]  # the contract-normalized row (scorer fields such as must_refuse included)
    prompt: list[dict[str, Any]]  # messages up to and including the last user turn (system prompt applied)
    tools: list[dict[str, Any]] | None
    reference: str | None  # the reference final answer (last assistant content), None if it only calls tools
    reference_calls: list[dict[str, Any]]  # [{"name", "arguments"}] the reference makes after the last user turn
    reference_turns: list[dict[str, Any]]  # the messages after the last user turn (assistant and tool turns)
    reference_results: list["ToolCall"] = field(default_factory=list)  # those calls executed (tool_execution)

    @property
    def last_user_text(self) -> str:
        return next((m["content"] for m in reversed(self.prompt) if m["role"] == "user"), "")


@dataclass
class ToolCall:
    """One tool call a model made (or the reference makes), and what executing it gave."""

    name: str
    arguments: dict[str, Any] | None  # None: the call did not parse into arguments
    ok: bool
    result: str | None  # the tool's result as the tool turn shows it (JSON text for non-strings)
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "ok": self.ok, "result": self.result,
                "error": self.error}


@dataclass
class ModelOutput:
    text: str  # the final answer: the visible text of the last turn (markup of an unfinished call removed)
    transcript: str  # every generated turn with the tool calls and their results, as the template renders them
    tool_calls: list[ToolCall]
    latency_s: float  # model time for this request: the generate calls it took part in
    generated_tokens: int
    finish: str  # "answer" | "length" | "tool_rounds_exhausted" | "bad_tool_call" | "error" | "teacher_forced"
    reference_loss: float | None = None  # set when the set has the reference_loss scorer
    error: str | None = None  # why the request failed (finish "error"): rendering, generation, a tool
    reference_loss_error: str | None = None  # why reference_loss is None for a reference_loss set
    reference_loss_not_available: str | None = None  # the backend cannot compute it (an engine): why
    preference: Any = None  # a preference set's `scorers.preference.PairLogps` of this pair
    preference_error: str | None = None  # why `preference` is None (its log-probabilities raised)
    preference_not_available: str | None = None  # the backend cannot compute it (an engine): why


@dataclass
class RowScore:
    values: dict[str, float | None]  # metric name -> this row's value (None: does not apply to this row)
    failures: list[str] = field(default_factory=list)  # short phrases; empty = the row passed this scorer
    fields: dict[str, bool] = field(default_factory=dict)  # per-field correctness (task_success)


def answer_text(text: str) -> str:
    """The answer part of generated text: after any reasoning (`...</think>`), stripped."""
    return text.split("</think>")[-1].strip()


def parse_json(text: str) -> tuple[Any, str | None]:
    """(value, None) when the answer parses as JSON, else (None, a short reason)."""
    answer = answer_text(text)
    if not answer:
        return None, "empty answer"
    try:
        return text_limits.parse_json(answer, "answer", max_bytes=MAX_ANSWER_BYTES), None
    except text_limits.JsonSyntaxError as exc:  # the short phrase of the reports
        return None, f"not valid JSON ({exc.error.msg} at column {exc.error.colno})"
    except ValueError as exc:
        return None, str(exc)  # nested too deep, too long


def short(value: Any, limit: int = 40) -> str:
    """A value for a failure phrase: JSON, cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"
