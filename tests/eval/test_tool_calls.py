"""The GLM-5 tool-call parser: the template's own rendering parses back to the call."""

from __future__ import annotations

from glmtune.data.chat_template import render_conversation
from glmtune.data.synthetic import LOOKUP_ORDER_TOOL
from glmtune.eval.tool_calls import parse_tool_calls

TOOLS = [LOOKUP_ORDER_TOOL, {"type": "function", "function": {
    "name": "convert", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "code": {"type": "string"}, "options": {"type": "object"}}}}}]


def _rendered_call(arguments: dict, name: str = "convert", content: str = "") -> str:
    """What the chat template writes for an assistant turn making this call (after `<|assistant|>`)."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}]
    text = render_conversation(messages, tools=TOOLS, enable_thinking=False)
    return text.split("<|assistant|>")[-1].removeprefix("</think>")


def test_template_rendering_round_trips():
    arguments = {"amount": 12.5, "code": "00123", "options": {"round": True, "to": ["EUR", "USD"]}}
    content, calls = parse_tool_calls(_rendered_call(arguments, content="Let me convert that."), TOOLS)
    assert content.strip() == "Let me convert that."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("convert", arguments, None)]
    # "00123" stays a string (the schema says string); an untyped JSON-looking value becomes JSON.
    _, [call] = parse_tool_calls("<tool_call>other<arg_key>n</arg_key><arg_value>42</arg_value>"
                                 "<arg_key>s</arg_key><arg_value>ORD-1</arg_value></tool_call>", TOOLS)
    assert call.arguments == {"n": 42, "s": "ORD-1"}


def test_two_calls_and_plain_text():
    text = ("<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-10005</arg_value></tool_call>\n"
            "<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-20001</arg_value></tool_call>")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "" and [c.arguments["order_id"] for c in calls] == ["ORD-10005", "ORD-20001"]
    assert parse_tool_calls('{"product": "PayFlow"}', TOOLS) == ('{"product": "PayFlow"}', [])


def test_malformed_calls_are_reported_not_dropped():
    cases = {
        "<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-1": "not closed",
        "<tool_call><arg_key>order_id</arg_key><arg_value>ORD-1</arg_value></tool_call>": "without a function name",
        "<tool_call>lookup_order<arg_key>order_id</arg_key>ORD-1</tool_call>": "malformed arguments",
        "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
        "</tool_call>": "given twice",
    }
    for text, reason in cases.items():
        _, [call] = parse_tool_calls(text, TOOLS)
        assert call.arguments is None and reason in call.error, (text, call)


def test_json_values_nested_too_deep_or_too_long_are_call_errors_not_crashes():
    deep = "[" * 1000 + "]" * 1000  # json.loads raises RecursionError on it
    for value, reason in ((deep, "JSON nested deeper than 64 levels"), ("[" * 65 + "]" * 65, "nested deeper"),
                          ("1" * (2 << 20), "bytes of JSON, more than the 1,048,576 allowed")):
        _, [call] = parse_tool_calls(f"<tool_call>convert<arg_key>options</arg_key><arg_value>{value}</arg_value>"
                                     "</tool_call>", TOOLS)
        assert call.arguments is None and call.error.startswith("argument 'options': ") and reason in call.error
    # Within the bounds it is JSON; text that is not JSON stays text; a string parameter is never parsed.
    _, [call] = parse_tool_calls(f"<tool_call>convert<arg_key>options</arg_key><arg_value>{'[' * 63 + ']' * 63}"
                                 f"</arg_value><arg_key>amount</arg_key><arg_value>[1, x</arg_value><arg_key>code"
                                 f"</arg_key><arg_value>{deep}</arg_value></tool_call>", TOOLS)
    assert call.error is None and call.arguments["amount"] == "[1, x" and call.arguments["code"] == deep
