"""Each scorer on hand-written outputs, and the aggregation of row scores into metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.data.synthetic import SCHEMA_PATH
from glmtune.eval.aggregate import field_records, set_metrics
from glmtune.eval.scorers import EvalRow, ModelOutput, ToolCall
from glmtune.eval.scorers.facts import Facts
from glmtune.eval.scorers.format import Format
from glmtune.eval.scorers.refusal import Refusal
from glmtune.eval.scorers.task_success import TaskSuccess
from glmtune.eval.scorers.tool_execution import ToolExecution

REFERENCE = {"product": "PayFlow", "severity": "high", "next_action": "reset_credentials"}


def row(reference=json.dumps(REFERENCE), category="login", calls=(), results=(), **data) -> EvalRow:
    return EvalRow("s", "r1", category, "f.jsonl:1", {"messages": [], **data}, [{"role": "user", "content": "q"}],
                   None, reference, list(calls), [], list(results))


def out(text: str, calls=()) -> ModelOutput:
    return ModelOutput(text, text, list(calls), 0.1, 5, "answer")


def test_task_success_exact_and_per_field():
    scorer = TaskSuccess(TaskSuccess.Options(), Path("."))
    exact = scorer.score(row(), out(' {"severity": "high", "next_action": "reset_credentials", "product": "PayFlow"}'))
    assert exact.values == {"exact": 1.0, "field_accuracy": 1.0} and not exact.failures
    wrong = scorer.score(row(), out('{"product": "PayFlow", "severity": "low"}'))
    assert wrong.values == {"exact": 0.0, "field_accuracy": pytest.approx(1 / 3)}
    assert wrong.fields == {"product": True, "severity": False, "next_action": False}
    assert wrong.failures == ["severity: got low, want high", "next_action: missing, want reset_credentials"]
    garbage = scorer.score(row(), out("PayFlow high"))
    assert garbage.values["exact"] == 0.0 and garbage.failures[0].startswith("not valid JSON")
    extra = TaskSuccess(TaskSuccess.Options(fields=["product"]), Path(".")).score(
        row(), out(json.dumps({**REFERENCE, "severity": "low"})))
    assert extra.fields == {"product": True} and extra.values["exact"] == 0.0 and extra.failures
    assert scorer.check_row(row(reference="not json")) and scorer.check_row(row(reference=None))


def test_format_parse_schema_and_critical():
    strict = Format(Format.Options(schema=str(SCHEMA_PATH)), Path("/"))
    good = strict.score(row(), out(json.dumps(REFERENCE)))
    assert good.values == {"valid_json": 1.0, "schema_valid": 1.0, "critical_failures": 0.0}
    invalid = strict.score(row(), out('{"product": "PayFlow", "severity": "urgent", "next_action": "x"}'))
    assert invalid.values == {"valid_json": 1.0, "schema_valid": 0.0, "critical_failures": 1.0}
    assert any(f.startswith("schema: 'urgent' is not one of") and f.endswith("at $.severity") for f in invalid.failures)
    parse_only = Format(Format.Options(schema=str(SCHEMA_PATH), critical="parse"), Path("/"))
    assert parse_only.score(row(), out('{"product": "x"}')).values["critical_failures"] == 0.0
    assert parse_only.score(row(), out('{"product": ')).values["critical_failures"] == 1.0
    assert [m.name for m in Format.metrics(Format.Options())] == ["valid_json", "critical_failures"]
    with pytest.raises(FileNotFoundError, match="no_such.json"):
        Format(Format.Options(schema="no_such.json"), Path("/tmp"))


def test_tool_execution_by_result_not_text():
    scorer = ToolExecution(ToolExecution.Options(), Path("."))
    want = ToolCall("lookup_order", {"order_id": "ORD-10005"}, True, '{"product": "PayFlow"}', None)
    tool_row = row(calls=[{"name": "lookup_order", "arguments": {"order_id": "ORD-10005"}}], results=[want])
    # Other argument text, same result: a success (scored by execution, not resemblance).
    same = ToolCall("lookup_order", {"order_id": "ORD-20003"}, True, '{"product": "PayFlow"}', None)
    assert scorer.score(tool_row, out("{}", [same])).values == {"success": 1.0, "spurious_calls": 0.0,
                                                                 "failed_calls": 0.0}
    other = ToolCall("lookup_order", {"order_id": "ORD-20004"}, True, '{"product": "MailDesk"}', None)
    assert "returned" in scorer.score(tool_row, out("{}", [other])).failures[0]
    raised = ToolCall("lookup_order", {"order_id": "x"}, False, None, "raised KeyError: 'x'")
    failed = scorer.score(tool_row, out("{}", [raised]))
    assert failed.values["failed_calls"] == 1.0 and failed.failures == ["lookup_order: raised KeyError: 'x'"]
    assert scorer.score(tool_row, out("{}")).failures == ["made 0 tool call(s), the reference 1 (lookup_order)"]
    spurious = scorer.score(row(), out("{}", [same]))
    assert spurious.values == {"success": 0.0, "spurious_calls": 1.0, "failed_calls": 0.0}
    assert scorer.score(row(), out("{}")).values["success"] == 1.0
    broken = row(calls=[{"name": "t", "arguments": {}}], results=[ToolCall("t", {}, False, None, "raised X")])
    assert scorer.check_row(broken) == ["the reference call to t fails: raised X"]


def test_facts_required_and_forbidden():
    scorer = Facts(Facts.Options(), Path("."))
    data = {"required_facts": ["9:30", ["Thursday", "thu"]], "forbidden_claims": ["10:30"]}
    assert scorer.score(row(**data), out("Opens at 9:30 on  THURSDAY.")).values == {
        "required_recall": 1.0, "supported": 1.0, "unsupported_claims": 0.0}
    half = scorer.score(row(**data), out("It opens at 10:30 on thu"))
    assert half.values == {"required_recall": 0.5, "supported": 0.0, "unsupported_claims": 1.0}
    assert half.failures == ["missing fact: 9:30", "unsupported claim: 10:30"]
    sensitive = Facts(Facts.Options(case_sensitive=True), Path("."))
    assert sensitive.score(row(**data), out("9:30 THURSDAY")).values["required_recall"] == 0.5
    assert scorer.check_row(row()) and scorer.check_row(row(required_facts=[3]))
    assert not scorer.check_row(row(forbidden_claims=["x"]))


def test_refusal_markers_and_patterns():
    scorer = Refusal(Refusal.Options(), Path("."))
    must, must_not = row(must_refuse=True), row(must_refuse=False)
    assert scorer.score(must, out("I'm sorry, I can't help with that.")).values == {
        "accuracy": 1.0, "over_refusals": 0.0, "under_refusals": 0.0}
    assert scorer.score(must, out('{"product": "PayFlow"}')).values["under_refusals"] == 1.0
    assert scorer.score(must_not, out("I cannot help with that")).failures == ["refused a prompt it must answer"]
    custom = Refusal(Refusal.Options(markers=[], patterns=[r"^\s*no\b"]), Path("."))
    assert custom.refuses("No. Not doing that.") and not custom.refuses("I'm sorry")
    assert scorer.check_row(row()) and not scorer.check_row(must)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Refusal(Refusal.Options(patterns=["("]), Path("."))
    with pytest.raises(ValueError, match="nothing could count as a refusal"):
        Refusal(Refusal.Options(markers=[]), Path("."))


def test_metrics_by_category_mean_sum_and_delta():
    scorer = Format(Format.Options(schema=str(SCHEMA_PATH)), Path("/"))
    rows = [row(category="a"), row(category="a"), row(category="b")]
    texts = {"base": ["x", "y", "z"], "candidate": [json.dumps(REFERENCE), "y", json.dumps(REFERENCE)]}
    scores = {label: {"s": {"format": [scorer.score(r, out(t)) for r, t in zip(rows, ts)]}}
              for label, ts in texts.items()}
    metrics = {m["id"]: m for m in set_metrics("s", rows, [scorer], scores, ["base", "candidate"])}
    valid = metrics["s/format/valid_json"]["by_category"]
    assert valid["all"] == {"n": 3, "values": {"base": 0.0, "candidate": pytest.approx(2 / 3)},
                            "delta": {"candidate": pytest.approx(2 / 3)}}
    assert valid["a"]["values"]["candidate"] == 0.5 and valid["b"]["n"] == 1
    critical = metrics["s/format/critical_failures"]
    assert critical["by_category"]["all"]["values"] == {"base": 3.0, "candidate": 1.0}  # counts sum
    assert critical["unit"] == "count" and critical["higher_is_better"] is False

    task = TaskSuccess(TaskSuccess.Options(), Path("."))
    task_scores = {label: {"s": {"task_success": [task.score(r, out(t)) for r, t in zip(rows, ts)]}}
                   for label, ts in texts.items()}
    fields = field_records("s", rows, task_scores, ["base", "candidate"])
    assert [(f["field"], f["n"], f["values"]["candidate"]) for f in fields] == [
        ("product", 3, pytest.approx(2 / 3)), ("severity", 3, pytest.approx(2 / 3)),
        ("next_action", 3, pytest.approx(2 / 3))]


def test_answers_nested_too_deep_fail_the_row_not_the_run():
    deep = out("[" * 1000 + "]" * 1000)
    score = TaskSuccess(TaskSuccess.Options(), Path(".")).score(row(), deep)
    assert score.values["exact"] == 0.0 and score.failures == ["answer: JSON nested deeper than 64 levels"]
    strict = Format(Format.Options(schema=str(SCHEMA_PATH)), Path("/")).score(row(), deep)
    assert strict.values == {"valid_json": 0.0, "schema_valid": 0.0, "critical_failures": 1.0}
