"""Tool calls parsed in the format of the model's chat template (eval/tool_call_formats.py): what
transformers' own rendering of Qwen3's (ChatML, Hermes `<tool_call>{json}</tool_call>`) and
Llama-3.1's (`{"name": ..., "parameters": ...}`) templates writes for a call parses back to that
call, and eval's tool loop picks the parser by the template's turn format (it parsed GLM-5's
format only: a Qwen3 call became a call named by its JSON text, a Llama-3 call an answer)."""

from __future__ import annotations

import pytest

from glmtune.data.chat_template import chat_format, load_chat_template
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.eval.answering import Prompting, _continue, _Request
from glmtune.eval.backends import Turn
from glmtune.eval.scorers import EvalRow
from glmtune.eval.suite import DecodingConfig
from glmtune.eval.tool_call_formats import parse_hermes_calls, parse_llama3_calls, parser_for
from tests.data.chat_format_fixtures import TOOL, build_tokenizer

ARGUMENTS = {"order_id": "00123", "amount": 12.5, "options": {"round": True, "to": ["EUR", "USD"]}}
CALL_TEXT = {  # a call of ARGUMENTS to lookup_order as each format's model writes it
    "glm": "<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>00123</arg_value><arg_key>amount"
           "</arg_key><arg_value>12.5</arg_value><arg_key>options</arg_key><arg_value>"
           '{"round": true, "to": ["EUR", "USD"]}</arg_value></tool_call>',
    "qwen3": '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "00123", "amount": 12.5, '
             '"options": {"round": true, "to": ["EUR", "USD"]}}}\n</tool_call>',
    "llama3_1": '{"name": "lookup_order", "parameters": {"order_id": "00123", "amount": 12.5, '
                '"options": {"round": true, "to": ["EUR", "USD"]}}}',
}


@pytest.fixture(scope="module")
def prompting(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_formats")
    out = {"glm": Prompting(load_tokenizer(None), load_chat_template(TINY_TOKENIZER_DIR), False, DecodingConfig())}
    for name in ("qwen3", "llama3_1"):
        build_tokenizer(root / name, name, vocab_size=400)
        out[name] = Prompting(load_tokenizer(root / name), load_chat_template(root / name), False, DecodingConfig())
    return out


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_transformers_rendering_of_a_call_parses_back_to_it(prompting, name):
    p = prompting[name]
    content = "Let me look." if name == "qwen3" else ""  # Llama-3.1's template drops a call turn's content
    messages = [{"role": "user", "content": "Where is order 00123?"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": {"name": "lookup_order", "arguments": ARGUMENTS}}]}]
    text = p.tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False)
    turns = chat_format(p.template).turns
    start, end = turns.assistant_char_spans(text)[-1]
    turn = text[start:end]
    for token in turns.supervised_ends:
        turn = turn.removesuffix(token)  # generation stops before the end-of-turn token
    visible, calls = parser_for(turns)(turn, [TOOL])
    assert visible.split("</think>")[-1].strip() == content  # Qwen3 writes an empty think block first
    assert [(c.name, c.arguments, c.error) for c in calls] == [("lookup_order", ARGUMENTS, None)]


def test_hermes_calls_two_and_malformed():
    text = ('I will check both.\n<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup_order", "arguments": "{\\"order_id\\": \\"2\\"}"}\n</tool_call>')
    content, calls = parse_hermes_calls(text)
    assert content == "I will check both.\n" and [c.arguments for c in calls] == [{"order_id": "1"}, {"order_id": "2"}]
    assert parse_hermes_calls('{"product": "PayFlow"}') == ('{"product": "PayFlow"}', [])
    cases = {
        '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id"': "not closed",
        "<tool_call>lookup_order</tool_call>": "not valid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "without a function name",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "not a JSON object",
        '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>': "given twice",
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>': "NaN",
        '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 100 + "]" * 100 + "}}</tool_call>": "nested deeper",
    }
    for text, reason in cases.items():
        _, [call] = parse_hermes_calls(text)
        assert call.arguments is None and reason in call.error, (text, call)


def test_llama3_calls_and_json_answers():
    call = '{"name": "lookup_order", "parameters": {"order_id": "7"}}'
    for text in (call, f"<|python_tag|>{call}", '{"type": "function", "name": "lookup_order", "arguments": '
                 '{"order_id": "7"}}'):
        assert parse_llama3_calls(text) == ("", parse_llama3_calls(call)[1]), text
        assert [(c.name, c.arguments) for c in parse_llama3_calls(text)[1]] == [("lookup_order", {"order_id": "7"})]
    for answer in ('{"category": "billing", "priority": "high"}', '{"name": "Ann", "email": "a@b.c"}',
                   "It shipped.", '{"reply": "no closing brace"'):
        assert parse_llama3_calls(answer) == (answer, []), answer
    _, [cut] = parse_llama3_calls('{"name": "lookup_order", "parameters": {"order')
    assert cut.arguments is None and "not valid JSON" in cut.error


def _row(name: str) -> EvalRow:
    messages = [{"role": "user", "content": "Where is order 00123?"}]
    return EvalRow("s", "r", "tool_call", "rows.jsonl:1", {"messages": messages}, messages, [TOOL], None, [], [])


@pytest.mark.parametrize("name", list(CALL_TEXT))
def test_the_tool_loop_parses_the_templates_own_format(prompting, name):
    request = _Request(_row(name), list(_row(name).prompt))
    assert not _continue(request, Turn(CALL_TEXT[name], "stop_token", 0, 0.0), False, None, prompting[name])
    assert request.output.finish == "tool_rounds_exhausted"
    assert [(c.name, c.arguments) for c in request.calls] == [("lookup_order", ARGUMENTS)]
    other = "qwen3" if name != "qwen3" else "glm"  # another format's call text is not this template's call
    request = _Request(_row(name), list(_row(name).prompt))
    _continue(request, Turn(CALL_TEXT[other], "stop_token", 0, 0.0), False, None, prompting[name])
    assert [(c.name, c.arguments) for c in request.calls] != [("lookup_order", ARGUMENTS)]
