"""The data contract every training row must satisfy, and row normalization.

Checks, each reported as `file:line: field: reason` (field like
`messages[2].tool_calls[0].function.arguments`):
  * the row is an object with a non-empty `messages` list; roles are known;
  * content is a string or a list of `{"type": "text", "text": ...}` parts
    (None only for an assistant turn that makes tool calls);
  * order: an optional system turn first, then user/assistant alternation; tool
    turns only right after an assistant turn with tool_calls, no more of them than
    there were calls; the conversation ends with an assistant turn;
  * at least one assistant turn has non-empty content or tool calls;
  * tool calls have a non-empty string name and object arguments (a JSON string
    that parses to an object is accepted and normalized), and name a declared tool
    when the row has `tools`;
  * no text contains control tokens: they would be tokenized as real control tokens and forge
    turn boundaries; GLM's (`<|user|>`, `<|endoftext|>`, ...) unless the caller gives the set of
    the template and tokenizer in use (chat_template.control_tokens: ChatML's `<|im_start|>`,
    `<|im_end|>`, Llama-3's headers, ...), as tokenization does;
  * optionally, the final answer (last assistant content, parsed as JSON) satisfies
    a JSON Schema.
Preference rows (prompt/chosen/rejected) reuse these checks through
`check_conversation` (see preferences.py).
`normalize_row` maps a valid row to the canonical form the rest of the pipeline
uses: text content, `{"type": "function", "function": {...}}` calls with dict
arguments, string group/id, and no None-valued keys (Parquet fills absent fields
with None).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from glmtune.data.sources import Origin, Row, loads_bounded
from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS
from glmtune.io.regular import check_regular_file
from glmtune.io.text_limits import parse_json

# A JSON Schema for answers is a few KiB; this bounds what a mistyped path (a dataset) would read.
MAX_SCHEMA_BYTES = 4 << 20

KNOWN_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Violation:
    origin: Origin
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.field}: {self.reason}"


def load_schema(path: str | Path) -> dict[str, Any]:
    """Read a JSON Schema file and check that it is itself a valid schema."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"schema file not found: {path}")
    check_regular_file(path, "schema file")  # a FIFO would block the read
    if path.stat().st_size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes, more than the {MAX_SCHEMA_BYTES:,} a JSON Schema "
                         "file may have (MAX_SCHEMA_BYTES)")
    schema = parse_json(path.read_bytes(), str(path))  # bounded depth: the validator recurses through it
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{path}: not a valid JSON Schema: {exc}") from exc
    return schema


def iter_strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string inside a JSON value, with its field path."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from iter_strings(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from iter_strings(item, f"{path}[{index}]")


def content_text(content: Any) -> str:
    """Visible text of a content field (string or text parts), as the template joins it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part if isinstance(part, str) else part.get("text") or "" for part in content)


def _parse_arguments(arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments as a dict, None) or (None, reason)."""
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        try:
            parsed = loads_bounded(arguments)
        except json.JSONDecodeError as exc:
            return None, f"JSON string does not parse: {exc.msg}"
        except ValueError as exc:  # nested too deep
            return None, f"JSON string: {exc}"
        if isinstance(parsed, dict):
            return parsed, None
        return None, f"JSON string encodes a {type(parsed).__name__}, expected an object"
    return None, f"must be an object (or a JSON string encoding one), got {type(arguments).__name__}"


def _call_function(call: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The dict holding name/arguments (OpenAI envelope or flat form) and its path."""
    if call.get("function") is not None:  # Parquet fills an absent envelope with None
        return call["function"], f"{path}.function"
    return call, path


class _RowChecker:
    """Collects the violations of one row."""

    def __init__(self, origin: Origin, schema: dict[str, Any] | None,
                 control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS):
        self.origin = origin
        self.schema = schema
        self.control_tokens = control_tokens
        self.violations: list[Violation] = []

    def add(self, field: str, reason: str) -> None:
        self.violations.append(Violation(self.origin, field, reason))

    def check(self, data: Any) -> list[Violation]:
        if not isinstance(data, dict):
            self.add("<row>", f"expected an object, got {type(data).__name__}")
            return self.violations
        for key in ("group", "id"):
            if data.get(key) is not None and not isinstance(data[key], (str, int)):
                self.add(key, f"must be a string, got {type(data[key]).__name__}")
        tool_names = self.check_tools(data.get("tools"))
        messages = data.get("messages")
        if messages is None:
            self.add("messages", "missing")
        elif not isinstance(messages, list):
            self.add("messages", f"must be a list of messages, got {type(messages).__name__}")
        elif not messages:
            self.add("messages", "is empty")
        else:
            structured = all([self.check_message(m, i, tool_names) for i, m in enumerate(messages)])
            if structured:  # order needs every message to be an object with a known role
                self.check_order(messages)
            if not self.violations:  # targets are read from well-formed content only
                self.check_target(messages)
            if self.schema is not None and not self.violations:
                self.check_final_answer(messages)
        return self.violations

    def check_tools(self, tools: Any) -> set[str] | None:
        if tools is None:
            return None
        if not isinstance(tools, list):
            self.add("tools", f"must be a list of tool specs, got {type(tools).__name__}")
            return None
        names = set()
        for k, tool in enumerate(tools):
            spec, path = (_call_function(tool, f"tools[{k}]") if isinstance(tool, dict) else (None, f"tools[{k}]"))
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
                self.add(f"{path}.name" if isinstance(spec, dict) else path, "tool spec needs a string name")
                continue
            names.add(spec["name"])
            self.check_control_tokens(tool, f"tools[{k}]")
        return names or None

    def check_control_tokens(self, value: Any, path: str) -> None:
        for field, text in iter_strings(value, path):
            for token in self.control_tokens:
                if token in text:
                    self.add(field, f"contains the control token {token!r}, which would forge a turn boundary")
                    break

    def check_message(self, message: Any, i: int, tool_names: set[str] | None) -> bool:
        """Check one message; True when it is an object with a known role."""
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            self.add(path, f"must be an object, got {type(message).__name__}")
            return False
        role = message.get("role")
        if role not in KNOWN_ROLES:
            self.add(f"{path}.role", f"unknown role {role!r} (expected one of {', '.join(KNOWN_ROLES)})")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            self.add(f"{path}.tool_calls", f"only assistant turns make tool calls, not {role!r}")
        elif calls is not None:
            self.check_tool_calls(calls, f"{path}.tool_calls", tool_names)
        content = message.get("content")
        if content is None:
            if not (role == "assistant" and calls):
                self.add(f"{path}.content", "missing (only an assistant turn with tool_calls may omit it)")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    self.add(f"{path}.content[{j}]", 'content parts must be {"type": "text", "text": str}')
        elif not isinstance(content, str):
            self.add(f"{path}.content", f"must be a string or a list of text parts, got {type(content).__name__}")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            self.add(f"{path}.reasoning_content", "must be a string on an assistant turn")
        self.check_control_tokens({k: v for k, v in message.items() if k != "role"}, path)
        return role in KNOWN_ROLES

    def check_tool_calls(self, calls: Any, path: str, tool_names: set[str] | None) -> None:
        if not isinstance(calls, list):
            self.add(path, f"must be a list, got {type(calls).__name__}")
            return
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                self.add(f"{path}[{j}]", f"must be an object, got {type(call).__name__}")
                continue
            if call.get("type") not in (None, "function"):
                self.add(f"{path}[{j}].type", f"must be 'function', got {call['type']!r}")
            function, fpath = _call_function(call, f"{path}[{j}]")
            if not isinstance(function, dict):
                self.add(fpath, f"must be an object, got {type(function).__name__}")
                continue
            name = function.get("name")
            if not isinstance(name, str) or not name:
                self.add(f"{fpath}.name", "must be a non-empty string")
            elif tool_names is not None and name not in tool_names:
                declared = ", ".join(sorted(tool_names))
                self.add(f"{fpath}.name", f"calls undeclared tool {name!r} (row declares {declared})")
            if "arguments" not in function or function["arguments"] is None:
                self.add(f"{fpath}.arguments", "missing (use {} for a call without arguments)")
                continue
            _, reason = _parse_arguments(function["arguments"])
            if reason:
                self.add(f"{fpath}.arguments", reason)

    def check_order(self, messages: list[dict[str, Any]]) -> None:
        previous: str | None = None  # role of the previous message
        open_calls = 0  # calls of the last assistant turn not yet answered by a tool turn
        caller = -1  # index of that assistant turn
        for i, message in enumerate(messages):
            role, path = message["role"], f"messages[{i}].role"
            if role == "system":
                if i != 0:
                    self.add(path, "a system turn is only allowed as the first message")
            elif role == "user":
                if previous == "assistant" and open_calls:
                    self.add(path, f"'user' cannot follow the tool calls of messages[{caller}]; "
                                   "tool responses must come first")
                elif previous not in (None, "system", "assistant"):
                    self.add(path, f"'user' cannot follow {previous!r}")
            elif role == "assistant":
                if previous not in ("user", "tool"):
                    self.add(path, f"'assistant' must follow a user or tool turn, not {previous!r}")
            elif previous in ("assistant", "tool") and caller >= 0:
                if open_calls == 0:
                    self.add(path, f"more tool responses than the {len(messages[caller]['tool_calls'])} "
                                   f"tool call(s) of messages[{caller}]")
                open_calls = max(open_calls - 1, 0)
            elif previous == "assistant":
                self.add(path, f"messages[{i - 1}] made no tool calls for this tool turn to answer")
            else:
                self.add(path, f"a tool turn must follow an assistant turn with tool_calls, not {previous!r}")
            if role == "assistant":
                calls = message.get("tool_calls")
                open_calls = len(calls) if isinstance(calls, list) else 0
                caller = i if open_calls else -1
            elif role != "tool":
                open_calls, caller = 0, -1
            previous = role
        if messages[-1]["role"] != "assistant":
            self.add(f"messages[{len(messages) - 1}].role",
                     f"conversation must end with an assistant turn, not {messages[-1]['role']!r}")

    def check_target(self, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            if message["role"] == "assistant" and (content_text(message.get("content")).strip()
                                                    or message.get("tool_calls")):
                return
        self.add("messages", "no assistant turn with non-empty content or tool calls to train on")

    def check_final_answer(self, messages: list[dict[str, Any]]) -> None:
        i = len(messages) - 1  # check_order guarantees the last message is the assistant's
        text = content_text(messages[i].get("content")).split("</think>")[-1].strip()
        if not text and messages[i].get("tool_calls"):
            return  # the final turn is a tool call; there is no answer to check
        path = f"messages[{i}].content"
        try:
            answer = loads_bounded(text)
        except json.JSONDecodeError as exc:
            self.add(path, f"final answer is not valid JSON ({exc.msg}) but a schema was given")
            return
        except ValueError as exc:  # nested too deep
            self.add(path, f"final answer: {exc}")
            return
        validator = jsonschema.validators.validator_for(self.schema)(self.schema)
        for error in sorted(validator.iter_errors(answer), key=lambda e: list(e.absolute_path)):
            self.add(path, f"final answer at {error.json_path}: {error.message}")


def check_conversation(data: Any, origin: Origin, schema: dict[str, Any] | None = None,
                       control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Violation]:
    """All contract violations of one parsed chat row (`{"messages": ..., "tools": ...}`)."""
    return _RowChecker(origin, schema, control_tokens).check(data)


def validate_row(row: Row, schema: dict[str, Any] | None = None,
                 control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Violation]:
    """All contract violations of one row (empty when valid)."""
    if row.parse_error is not None:
        return [Violation(row.origin, "<row>", row.parse_error)]
    return check_conversation(row.data, row.origin, schema, control_tokens)


def validate_rows(rows: Iterable[Row], schema: dict[str, Any] | None = None,
                  control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Violation]:
    """All violations of all rows, in input order."""
    return [violation for row in rows for violation in validate_row(row, schema, control_tokens)]


def check_or_raise(rows: Iterable[Row], schema: dict[str, Any] | None = None, max_shown: int = 10,
                   control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Row]:
    """Validate everything; raise ValueError listing the first violations, else return
    the rows normalized (see `normalize_row`). `control_tokens`: the text no string may hold."""
    rows = list(rows)
    violations = validate_rows(rows, schema, control_tokens)
    if violations:
        raise violations_error(violations, max_shown)
    return [Row(normalize_row(row.data), row.origin) for row in rows]


def violations_error(violations: list[Violation], max_shown: int = 10) -> ValueError:
    """The ValueError `check_or_raise` raises for a non-empty list of violations."""
    # The first line names the first violation: a one-line error display keeps file:line.
    shown = "".join(f"\n  {v}" for v in violations[1:max_shown])
    more = f"\n  ... and {len(violations) - max_shown} more" if len(violations) > max_shown else ""
    return ValueError(f"{len(violations)} data contract violation(s) (run `glmtune data validate` for all); "
                      f"the first: {violations[0]}{shown}{more}")


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """Canonical form of one valid message (text content, dict tool-call arguments)."""
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = content_text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or []:
        function, _ = _call_function(call, "")
        arguments, reason = _parse_arguments(function["arguments"])
        assert reason is None, "normalize_row needs a validated row"
        normalized = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call.get("id") is not None:
            normalized["id"] = call["id"]
        calls.append(normalized)
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def normalize_fields(data: dict[str, Any], message_fields: Iterable[str]) -> dict[str, Any]:
    """Canonical form of a valid row whose messages are in `message_fields` (each a list of
    messages): None-valued keys dropped, each message normalized (`normalize_message`), an
    empty `tools` dropped, group/id as strings. The input is not modified.

    The common part of `normalize_row` (chat rows, `messages`) and
    `preferences.normalize_preference_row` (prompt/chosen/rejected).
    """
    out = {key: value for key, value in data.items() if value is not None}
    for field in message_fields:
        out[field] = [normalize_message(message) for message in data[field]]
    if not out.get("tools"):
        out.pop("tools", None)
    for key in ("group", "id"):
        if key in out:
            out[key] = str(out[key])
    return out


def normalize_row(data: dict[str, Any]) -> dict[str, Any]:
    """Canonical form of a valid row (see module docstring); the input is not modified."""
    return normalize_fields(data, ("messages",))
