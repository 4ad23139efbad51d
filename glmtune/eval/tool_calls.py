"""GLM-5 tool calls in generated text, parsed back into (name, arguments).

The chat template (glmtune/data/templates/glm5.jinja) renders a call as

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value><arg_key>K2</arg_key>...</tool_call>

with string values written raw and every other value as JSON. Parsing inverts that the way
serving engines' GLM parsers do: a value whose parameter the tool's JSON schema types as
`string` stays the raw text (so an id "00123" is not read as the number 123); any other value
that parses as JSON is that JSON value, else the raw text. The visible content is the text
before the first `<tool_call>`. A call that is not closed (generation stopped inside it), has
no name, or has unpaired keys and values is returned with `error` set, not silently dropped;
so is one whose value is JSON nested deeper than `io.text_limits.MAX_JSON_DEPTH` or longer than
MAX_VALUE_BYTES (a model's output is untrusted: parsing it must not raise RecursionError), holds
a number JSON cannot carry (NaN, Infinity, 1e999: it would reach the scorecard as a bare NaN),
an object giving a key twice, or a lone surrogate. The chat API's calls (`endpoint._engine_calls`)
are refused alike: `ARGUMENTS` are the parse options both use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from glmtune.io.text_limits import JsonSyntaxError, parse_json

MAX_VALUE_BYTES = 1 << 20  # one argument value; a generation of 32768 tokens is rarely a fifth of it
ARGUMENTS = {"allow_nan": False, "unique_keys": True}  # parse_json's options for a call's arguments
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any] | None  # None when `error` is set
    error: str | None = None


def _string_params(tools: list[dict[str, Any]] | None, name: str) -> set[str]:
    """Parameters the named tool's schema types as string (only) in the row's tool specs."""
    for tool in tools or []:
        spec = tool.get("function", tool)
        if spec.get("name") == name:
            properties = (spec.get("parameters") or {}).get("properties") or {}
            return {key for key, schema in properties.items()
                    if isinstance(schema, dict) and schema.get("type") == "string"}
    return set()


def _value(text: str, as_string: bool, key: str) -> Any:
    """The argument's value; ValueError for JSON too deep or too long to take."""
    if as_string:
        return text
    try:
        return parse_json(text, f"argument {key!r}", max_bytes=MAX_VALUE_BYTES, **ARGUMENTS)
    except JsonSyntaxError:  # text that is not JSON is the raw text; over the bounds, the call's error
        return text


def _call(name: str, pairs: list[tuple[str, str]], strings: set[str]) -> ParsedCall:
    arguments = {}
    for key, value in pairs:
        key = key.strip()
        if key in arguments:
            return ParsedCall(name, None, f"argument {key!r} given twice")
        try:
            arguments[key] = _value(value, key in strings, key)
        except ValueError as exc:
            return ParsedCall(name, None, str(exc))
    return ParsedCall(name, arguments)


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedCall]]:
    """(visible content before the first call, the calls in order)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        body, closed = match.group(1), bool(match.group(2))
        head = body.split("<arg_key>", 1)[0]
        name = head.strip()
        if not closed:
            calls.append(ParsedCall(name, None, "tool call not closed (generation stopped inside it)"))
            continue
        if not name or "<" in name:
            calls.append(ParsedCall(name, None, "tool call without a function name"))
            continue
        pairs = _PAIR.findall(body)
        rest = _PAIR.sub("", body[len(head):]).strip()
        if rest:
            calls.append(ParsedCall(name, None, f"malformed arguments near {rest[:30]!r}"))
            continue
        calls.append(_call(name, pairs, _string_params(tools, name)))
    return text[:start], calls

