"""One example's trouble stays on that example: a model output nested 1000 deep, a generation that
raises for one prompt, a tool schema the validator cannot use, a scorer that raises. Each goes
through the real loop (`evaluate.answer_set`: the tool-call loop, the executor, every scorer) and
the scorecard's example records; only `generate` is a stand-in that writes the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.data.chat_template import bundled_template
from glmtune.data.synthetic import LOOKUP_ORDER_TOOL
from glmtune.data.tokenizer import load_tokenizer
from glmtune.eval.aggregate import example_records
from glmtune.eval.backends import LocalModel
from glmtune.eval.evaluate import answer_set
from glmtune.eval.models import ModelSource
from glmtune.eval.answering import Prompting
from glmtune.eval.scorers.format import Format
from glmtune.eval.sets import load_sets
from glmtune.eval.suite import load_suite
from glmtune.eval.tools import ToolExecutor
from tests.eval.fake_model import DEEP_ARGUMENT, DEEP_CALL, FakeGenerate

HF = ModelSource("candidate", "candidate", Path("/models/x"), "hf", Path("/models/x"))
ANSWER = '{"product": "PayFlow"}'


def _row(row_id: str, user: str, tools=(LOOKUP_ORDER_TOOL,)) -> dict:
    return {"id": row_id, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ANSWER}],
            "tools": list(tools)}


def _answer(tmp_path: Path, rows: list[dict], answers: dict, monkeypatch) -> tuple[dict, FakeGenerate]:
    """{row id: the example record of the candidate} after the real loop and scoring on `rows`."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "suite.yaml").write_text(
        "name: s\nversion: 1\ndecoding: {max_tool_rounds: 1}\n"
        "tools: {functions: {lookup_order: 'glmtune.data.synthetic:lookup_order'}}\n"
        "sets:\n  - {name: t, path: rows.jsonl, scorers: [tool_execution, task_success, format]}\n")
    suite = load_suite(tmp_path / "suite.yaml")
    [loaded] = load_sets(suite, HF)
    tokenizer = load_tokenizer()
    fake = FakeGenerate(tokenizer, answers)
    monkeypatch.setattr("glmtune.eval.backends.generate", fake)
    prompting = Prompting(tokenizer, bundled_template(), False, suite.file.decoding)
    with ToolExecutor(suite.file.tools.functions, 10, tmp_path) as executor:
        outs, scores, _ = answer_set(LocalModel(None), loaded, prompting, executor, 0)
    records = example_records("t", loaded.rows, {"candidate": outs}, {"candidate": {"t": scores}}, ["candidate"])
    return {r["id"]: r["outputs"]["candidate"] for r in records}, fake


def test_a_tool_call_nested_1000_deep_is_a_failed_example_with_the_reason(tmp_path, monkeypatch):
    examples, _ = _answer(tmp_path, [_row("deep", "deep please"), _row("deep-answer", "answer deep"),
                                     _row("ok", "fine")],
                          {"deep please": DEEP_CALL, "answer deep": DEEP_ARGUMENT}, monkeypatch)
    deep = examples["deep"]
    assert deep["finish"] == "bad_tool_call" and not deep["passed"]
    assert "lookup_order: argument 'filters': JSON nested deeper than 64 levels" in deep["failures"]
    assert deep["tool_calls"][0]["arguments"] is None
    # The same nesting as a JSON answer: the JSON scorers fail the row, they do not raise.
    answer = examples["deep-answer"]
    assert not answer["passed"] and "answer: JSON nested deeper than 64 levels" in answer["failures"]
    assert examples["ok"]["passed"] and examples["ok"]["failures"] == []


def test_a_generation_error_fails_only_its_request(tmp_path, monkeypatch):
    rows = [_row("a", "fine"), _row("boom", "explode"), _row("c", "fine too")]
    examples, fake = _answer(tmp_path, rows, {"explode": RuntimeError("device-side assert")}, monkeypatch)
    assert fake.calls == [3, 1, 1, 1]  # the batch raised: each request alone, so only one fails
    boom = examples["boom"]
    assert boom["finish"] == "error" and boom["error"] == "generation failed: RuntimeError: device-side assert"
    assert boom["failures"][0] == boom["error"] and not boom["passed"]
    assert examples["a"]["passed"] and examples["c"]["passed"]


def test_when_every_request_fails_in_generation_the_model_is_broken(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="out of memory"):  # glmtune eval: an internal error, exit 3
        _answer(tmp_path, [_row("a", "fine"), _row("b", "fine")], {"fine": RuntimeError("out of memory")},
                monkeypatch)


def test_a_tool_schema_that_cannot_validate_fails_the_call(tmp_path, monkeypatch):
    broken = {"type": "function", "function": {**LOOKUP_ORDER_TOOL["function"], "parameters": {
        "type": "object", "properties": {"order_id": {"type": "strin"}}}}}  # jsonschema raises UnknownType
    call = "<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-10005</arg_value></tool_call>"
    examples, _ = _answer(tmp_path, [_row("typo", "look it up", [broken]), _row("ok", "fine")],
                          {"look it up": call}, monkeypatch)
    failed = examples["typo"]["tool_calls"][0]  # the second round calls again, not executed
    assert not failed["ok"] and "parameters schema of 'lookup_order' is not a valid JSON Schema" in failed["error"]
    assert not examples["typo"]["passed"] and examples["ok"]["passed"]


def test_a_scorer_that_raises_fails_that_example_only(tmp_path, monkeypatch):
    real = Format.score

    def score(self, row, output):
        if row.id == "odd":
            raise ZeroDivisionError("division by zero")
        return real(self, row, output)

    monkeypatch.setattr(Format, "score", score)
    examples, _ = _answer(tmp_path, [_row("odd", "fine"), _row("ok", "fine")], {}, monkeypatch)
    assert examples["odd"]["failures"] == ["format failed: ZeroDivisionError: division by zero"]
    assert examples["ok"]["passed"]


def test_a_scorer_that_raises_on_every_row_is_broken(tmp_path, monkeypatch):
    def score(self, row, output):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(Format, "score", score)
    with pytest.raises(ZeroDivisionError):  # glmtune eval: an internal error, exit 3
        _answer(tmp_path, [_row("a", "fine"), _row("b", "fine")], {}, monkeypatch)
