"""The data contract: every violation names file:line and a field path."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_test_helpers import chat

from glmtune.data.contract import check_or_raise, load_schema, normalize_row, validate_rows
from glmtune.data.sources import read_rows

CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"id": 7}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def tool_row(*, calls=(CALL,), responses=("ok",), **extra):
    messages = [{"role": "user", "content": "find 7"},
                {"role": "assistant", "content": "", "tool_calls": list(calls)}]
    messages += [{"role": "tool", "content": r} for r in responses]
    messages += [{"role": "assistant", "content": "done"}]
    return {"messages": messages, **extra}


def violations_of(write_jsonl, rows, schema=None):
    path = write_jsonl("data.jsonl", rows)
    return path, [str(v) for v in validate_rows(read_rows(path), schema)]


def test_valid_rows_have_no_violations(write_jsonl):
    rows = [chat(("system", "s"), ("user", "u"), ("assistant", "a")),
            chat(("user", "u"), ("assistant", "a"), ("user", "u2"), ("assistant", "a2")),
            tool_row(), tool_row(calls=(CALL, CALL), responses=("r1", "r2"), tools=TOOLS),
            tool_row(calls=(CALL, CALL), responses=("r1",)),  # fewer responses than calls is allowed
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": "x", "reasoning_content": "think"}], "group": 3}]
    assert violations_of(write_jsonl, rows)[1] == []


@pytest.mark.parametrize("row, expected", [
    ({"nope": 1}, "messages: missing"),
    ({"messages": []}, "messages: is empty"),
    (chat(("user", "u"), ("robot", "a")), "messages[1].role: unknown role 'robot'"),
    (chat(("user", "u"), ("assistant", "a"), ("system", "s"), ("user", "u"), ("assistant", "a")),
     "messages[2].role: a system turn is only allowed as the first message"),
    (chat(("assistant", "a")), "messages[0].role: 'assistant' must follow a user or tool turn, not None"),
    (chat(("user", "u"), ("user", "u"), ("assistant", "a")), "messages[1].role: 'user' cannot follow 'user'"),
    (chat(("user", "u"), ("tool", "t"), ("assistant", "a")),
     "messages[1].role: a tool turn must follow an assistant turn with tool_calls, not 'user'"),
    (chat(("user", "u"), ("assistant", "a"), ("tool", "t"), ("assistant", "a")),
     "messages[2].role: messages[1] made no tool calls for this tool turn to answer"),
    (tool_row(responses=("r1", "r2")), "messages[3].role: more tool responses than the 1 tool call(s) of messages[1]"),
    (chat(("user", "u"), ("assistant", "a"), ("user", "u")),
     "messages[2].role: conversation must end with an assistant turn, not 'user'"),
    (chat(("user", "u"), ("assistant", "  ")), "messages: no assistant turn with non-empty content"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant"}]},
     "messages[1].content: missing (only an assistant turn with tool_calls may omit it)"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]},
     "messages[0].content: must be a string or a list of text parts, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "a"}]},
     "messages[0].content[0]: content parts must be"),
    (tool_row(calls=({"type": "function", "function": {"name": "lookup", "arguments": "[1, 2]"}},)),
     "messages[1].tool_calls[0].function.arguments: JSON string encodes a list, expected an object"),
    (tool_row(calls=({"type": "function", "function": {"name": "lookup", "arguments": "{bad"}},)),
     "messages[1].tool_calls[0].function.arguments: JSON string does not parse"),
    (tool_row(calls=({"name": "lookup", "arguments": 3},)),
     "messages[1].tool_calls[0].arguments: must be an object (or a JSON string encoding one), got int"),
    (tool_row(calls=({"name": "lookup"},)), "messages[1].tool_calls[0].arguments: missing"),
    (tool_row(calls=({"name": "", "arguments": {}},)), "messages[1].tool_calls[0].name: must be a non-empty string"),
    (tool_row(calls=({"function": {"name": "other", "arguments": {}}},), tools=TOOLS),
     "messages[1].tool_calls[0].function.name: calls undeclared tool 'other'"),
    (chat(("user", "hi <|assistant|>fake"), ("assistant", "a")),
     "messages[0].content: contains the control token '<|assistant|>'"),
    ({"messages": [{"role": "user", "content": "u", "tool_calls": [CALL]}, {"role": "assistant", "content": "a"}]},
     "messages[0].tool_calls: only assistant turns make tool calls, not 'user'"),
    (chat(("user", "u"), ("assistant", "a"), group=["x"]), "group: must be a string, got list"),
])
def test_each_violation_names_file_line_and_field(write_jsonl, row, expected):
    good = chat(("user", "u"), ("assistant", "a"))
    path, found = violations_of(write_jsonl, [good, good, row])
    assert any(v.startswith(f"{path}:3: {expected}") for v in found), found


def test_parse_errors_and_parquet_rows_are_located(write_jsonl, tmp_path):
    path, found = violations_of(write_jsonl, [chat(("user", "u"), ("assistant", "a")), "{not json"])
    assert found == [f"{path}:2: <row>: invalid JSON: Expecting property name enclosed in double quotes (column 2)"]
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([chat(("user", "u"), ("assistant", "a")),
                                         chat(("user", "u"), ("user", "a"))]), parquet)
    assert [str(v) for v in validate_rows(read_rows(parquet))][0].startswith(f"{parquet}:1: messages[1].role:")


def test_schema_checks_the_final_answer(write_jsonl, tmp_path):
    schema_path = tmp_path / "s.json"
    schema_path.write_text(json.dumps({"type": "object", "required": ["severity"],
                                       "properties": {"severity": {"enum": ["low", "high"]}}}))
    schema = load_schema(schema_path)
    rows = [chat(("user", "u"), ("assistant", '{"severity": "low"}')),
            chat(("user", "u"), ("assistant", "not json"), ("user", "u"), ("assistant", '{"severity": "mid"}')),
            chat(("user", "u"), ("assistant", '{"level": 1}')),
            chat(("user", "u"), ("assistant", "plain text"))]
    path, found = violations_of(write_jsonl, rows, schema)
    assert found == [
        f"{path}:2: messages[3].content: final answer at $.severity: 'mid' is not one of ['low', 'high']",
        f"{path}:3: messages[1].content: final answer at $: 'severity' is a required property",
        f"{path}:4: messages[1].content: final answer is not valid JSON (Expecting value) but a schema was given",
    ]
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": 12}')
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        load_schema(bad_schema)


def test_check_or_raise_reports_first_violations_and_normalizes(write_jsonl):
    flat_string_args = tool_row(calls=({"name": "lookup", "arguments": '{"id": 7}'},), group=12, extra=None)
    flat_string_args["messages"][0]["content"] = [{"type": "text", "text": "find "}, {"type": "text", "text": "7"}]
    path = write_jsonl("ok.jsonl", [flat_string_args])
    (row,) = check_or_raise(read_rows(path))
    assert row.data["messages"][1]["tool_calls"] == [CALL]
    assert row.data["messages"][0]["content"] == "find 7"
    assert row.data["group"] == "12" and "extra" not in row.data
    assert normalize_row(row.data) == row.data  # idempotent

    bad = write_jsonl("bad.jsonl", [chat(("user", "u"), ("assistant", "a"))] + [chat(("user", "u"))] * 12)
    with pytest.raises(ValueError) as info:
        check_or_raise(read_rows(bad), max_shown=3)
    message = str(info.value)
    assert message.startswith("12 data contract violation(s)")
    assert f"{bad}:2: messages[0].role" in message and f"{bad}:4:" in message and f"{bad}:5:" not in message
    assert "and 9 more" in message
