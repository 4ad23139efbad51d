"""Tool calls in generated text, in the format of the model's chat template.

The parser is chosen by the template's turn format (data/turn_formats.py), never guessed from an
answer, because each family's template renders an assistant's call its own way and the model
learned that way:

  * GLM: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
    (tool_calls.parse_tool_calls);
  * ChatML (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`,
    one block per call, the visible content before the first;
  * Llama-3 (3.1-3.3): the whole turn is `{"name": NAME, "parameters": {...}}` (the template
    allows one call a turn; vLLM's llama3_json parser also takes "arguments" and a leading
    `<|python_tag|>`, and so does this);
  * a template known only by its generation blocks renders no calls glmtune knows: its text is
    the answer.

A JSON call is taken whole, as the chat API's calls are (`endpoint._engine_calls`): a body that is
not JSON, has no string "name", or whose arguments are not an object (or a string holding one)
is a failed call with the reason, as are the bounds and refusals of tool_calls.ARGUMENTS (depth,
size, NaN, a key given twice). A Llama-3 turn is a call only when it is such an object and
nothing else (keys name and parameters/arguments, optionally type "function"), so a JSON answer
such as `{"category": ...}` stays an answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from glmtune.data.turn_formats import CHATML, GLM, LLAMA3, TurnFormat
from glmtune.eval.tool_calls import ARGUMENTS, MAX_VALUE_BYTES, ParsedCall, parse_tool_calls
from glmtune.io.text_limits import parse_json

Parser = Callable[[str, "list[dict[str, Any]] | None"], "tuple[str, list[ParsedCall]]"]

_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_CALL_KEYS = ({"name", "parameters"}, {"name", "arguments"})


def _json_call(body: str) -> ParsedCall:
    """A JSON call object's name and arguments, or the reason it is not one."""
    try:
        value = parse_json(body, "the tool call", max_bytes=MAX_VALUE_BYTES, **ARGUMENTS)
    except ValueError as exc:
        return ParsedCall("", None, str(exc))
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"].strip():
        return ParsedCall("", None, "tool call without a function name")
    name = value["name"].strip()
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = parse_json(arguments, f"{name} arguments", max_bytes=MAX_VALUE_BYTES, **ARGUMENTS)
        except ValueError as exc:
            return ParsedCall(name, None, str(exc))
    if not isinstance(arguments, dict):
        return ParsedCall(name, None, "arguments are not a JSON object")
    return ParsedCall(name, arguments)


def parse_hermes_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedCall]]:
    """ChatML's `<tool_call>{json}</tool_call>` blocks: (visible content before the first, the calls)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        if not match.group(2):
            calls.append(ParsedCall("", None, "tool call not closed (generation stopped inside it)"))
        else:
            calls.append(_json_call(match.group(1).strip()))
    return text[:start], calls


def parse_llama3_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedCall]]:
    """A Llama-3 turn that is one JSON call (see module docstring): ("", [call]); else (text, [])."""
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    try:
        value = parse_json(body, "the tool call", max_bytes=MAX_VALUE_BYTES, **ARGUMENTS)
    except ValueError as exc:
        # Cut off, malformed or over the bounds: a failed call when it began as one (the tag, or a
        # leading "name" key), else the answer's text.
        if tagged or re.match(r'\{\s*"name"\s*:', body):
            return "", [ParsedCall("", None, str(exc))]
        return text, []
    keys = set(value) - {"type"} if isinstance(value, dict) and value.get("type", "function") == "function" else None
    if keys not in _CALL_KEYS:
        return text, []
    return "", [_json_call(body)]


def _no_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedCall]]:
    return text, []


PARSERS: dict[str, Parser] = {GLM.name: parse_tool_calls, CHATML.name: parse_hermes_calls,
                              LLAMA3.name: parse_llama3_calls}


def parser_for(turns: TurnFormat) -> Parser:
    """The tool-call parser of a template of turn format `turns` (none for generation blocks only)."""
    return PARSERS.get(turns.name, _no_calls)
