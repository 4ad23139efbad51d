"""The tool-call loop's turn handling: a generated call, executed through the bundled lookup_order,
rebuilds exactly the conversation the training data holds (so the next prompt is what training saw)."""

from __future__ import annotations

from pathlib import Path

from glmtune.data.chat_template import render_conversation
from glmtune.data.contract import normalize_row
from glmtune.data.synthetic import generate_rows
from glmtune.eval.answering import _continue, _Request
from glmtune.eval.backends import Turn
from glmtune.eval.scorers.base import EvalRow
from glmtune.eval.tools import ToolExecutor


def _tool_row() -> dict:
    return next(normalize_row(r) for r in generate_rows(50, seed=3) if r["category"] == "tool_call")


def _generated_call(row: dict) -> str:
    """The text a model trained on this row generates for its call turn (the template's own rendering)."""
    text = render_conversation(row["messages"][:3], tools=row["tools"], enable_thinking=False)
    return text.split("<|assistant|>")[-1].removeprefix("</think>")


def test_a_generated_call_is_executed_and_the_conversation_continues_as_in_training(tmp_path):
    row = _tool_row()
    eval_row = EvalRow("t", row["id"], "tool_call", "x:1", row, row["messages"][:2], row["tools"], None, [],
                       row["messages"][2:])
    request = _Request(eval_row, list(eval_row.prompt))
    with ToolExecutor({"lookup_order": "glmtune.data.synthetic:lookup_order"}, 10, tmp_path) as executor:
        assert _continue(request, Turn(_generated_call(row), "stop_token", 0, 0.0), True, executor)
    [call] = request.calls
    assert call.ok and call.result == row["messages"][3]["content"]  # the data's tool response
    assert request.messages == row["messages"][:4]
    def prompt(messages):
        return render_conversation(messages, tools=row["tools"], enable_thinking=False, add_generation_prompt=True)
    assert prompt(request.messages) == prompt(row["messages"][:4])

    answer = row["messages"][4]["content"]
    assert not _continue(request, Turn(answer, "stop_token", 0, 0.0), True, executor)
    assert request.output.text == answer and request.output.finish == "answer"
    assert "<|observation|><tool_response>" in request.output.transcript


def test_calls_beyond_max_tool_rounds_or_unparseable_end_the_request(tmp_path):
    row = _tool_row()
    eval_row = EvalRow("t", row["id"], "tool_call", "x:1", row, row["messages"][:2], row["tools"], None, [],
                       row["messages"][2:])
    with ToolExecutor({"lookup_order": "glmtune.data.synthetic:lookup_order"}, 10, Path(tmp_path)) as executor:
        exhausted = _Request(eval_row, list(eval_row.prompt))
        assert not _continue(exhausted, Turn("Checking." + _generated_call(row), "stop_token", 0, 0.0), False, executor)
        assert exhausted.output.finish == "tool_rounds_exhausted" and exhausted.output.text == "Checking."
        assert exhausted.calls[0].error == "not executed: max_tool_rounds reached"
        cut = _Request(eval_row, list(eval_row.prompt))
        assert not _continue(cut, Turn("<tool_call>lookup_order<arg_key>order_id", "length", 0, 0.0), True, executor)
        assert cut.output.finish == "bad_tool_call" and "not closed" in cut.calls[0].error
