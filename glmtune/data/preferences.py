"""Preference rows (TRL's conversational preference format): kind, contract, tokenization.

A preference row holds one prompt and two answers to it:
    {"prompt":   [messages ending before the answer],
     "chosen":   [the preferred assistant message(s)],
     "rejected": [the other assistant message(s)],
     "tools": [...], "group": str, "id": str, "category": str (optional)}
An answer may make tool calls (assistant turn with tool_calls, tool turns, final
assistant turn), as SFT rows may. A row with any of prompt/chosen/rejected is a
preference row, any other row a chat row (`row_kind`); one file holds one kind, and
a dataset (all inputs of a command) too.

Contract (`validate_preference_row`), reported as `file:line: field: reason` with
fields like `chosen[0].content` or `prompt[2].role`:
  * prompt + chosen and prompt + rejected are each a valid SFT conversation
    (contract.py), ending with an assistant turn;
  * the prompt does not end with an assistant turn, and each answer starts with an
    assistant turn and holds only assistant and tool turns;
  * each answer has an assistant turn with content or tool calls to score;
  * chosen and rejected differ (after normalization);
  * a final-answer JSON Schema applies to chosen only: a rejected answer is often
    wrong on purpose (invalid JSON, say).

Tokenization (`tokenize_pair`) renders prompt + chosen and prompt + rejected through
the chat template exactly as SFT does (`chat_template.tokenize_conversation`) and
keeps the labels of the answer only: everything after the answer's first
`<|assistant|>` token, the token that ends the turn included. Assistant turns of the
prompt are context, never targets. The prompt tokens of the two must be identical
(same rendered prefix); a template for which they are not is a ValueError.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample, tokenize_conversation
from glmtune.data.contract import (Violation, check_conversation, content_text, normalize_fields, normalize_message,
                                   normalize_row, validate_row, violations_error)
from glmtune.data.sources import Origin, Row
from glmtune.data.tokenizer import GLM5_CONTROL_TOKENS

PREFERENCE_FIELDS: tuple[str, ...] = ("prompt", "chosen", "rejected")
ANSWER_FIELDS: tuple[str, ...] = ("chosen", "rejected")
ROW_KINDS: tuple[str, ...] = ("chat", "preference")
_MESSAGE_INDEX = re.compile(r"messages\[(\d+)\]")


def row_kind(data: Any) -> str:
    """"preference" for an object with prompt, chosen or rejected; else "chat".

    A None value counts as absent: Parquet fills missing columns with None.
    """
    if isinstance(data, dict) and any(data.get(field) is not None for field in PREFERENCE_FIELDS):
        return "preference"
    return "chat"


def _relabel(violation: Violation, num_prompt: int, answer: str) -> Violation:
    """A violation of the joined conversation, renamed to prompt[i] / answer[j] paths."""

    def rename(match: re.Match[str]) -> str:
        i = int(match.group(1))
        return f"prompt[{i}]" if i < num_prompt else f"{answer}[{i - num_prompt}]"

    field = _MESSAGE_INDEX.sub(rename, violation.field)
    return Violation(violation.origin, field, _MESSAGE_INDEX.sub(rename, violation.reason))


def _role_violations(origin: Origin, prompt: list[Any], answer: list[Any], name: str) -> list[Violation]:
    """Where the answer starts and what it may hold (see module docstring)."""
    found = []
    last = prompt[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        found.append(Violation(origin, f"prompt[{len(prompt) - 1}].role", "the prompt must end before the answer, "
                               "not with an assistant turn (that turn belongs in chosen/rejected)"))
    for j, message in enumerate(answer):
        role = message.get("role") if isinstance(message, dict) else None
        if j == 0 and role in ("tool", "user", "system"):
            found.append(Violation(origin, f"{name}[0].role", f"an answer starts with an assistant turn, not {role!r}"))
        elif role in ("user", "system"):
            found.append(Violation(origin, f"{name}[{j}].role",
                                   f"an answer holds assistant and tool turns only, not {role!r}"))
    return found


def _answer_violations(data: dict[str, Any], origin: Origin, name: str, schema: dict[str, Any] | None,
                       control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Violation]:
    """Violations of prompt + one answer, as an SFT conversation and as an answer."""
    prompt, answer = data["prompt"], data[name]
    conversation = {"messages": prompt + answer, "tools": data.get("tools"), "group": data.get("group"),
                    "id": data.get("id")}
    # The SFT "no target" check looks at the whole conversation; an answer needs its own (below).
    found = [_relabel(v, len(prompt), name) for v in check_conversation(conversation, origin, schema,
                                                                             control_tokens) if v.field != "messages"]
    found += _role_violations(origin, prompt, answer, name)
    if not any(v.field.startswith(name) for v in found) and not any(
            m["role"] == "assistant" and (content_text(m.get("content")).strip() or m.get("tool_calls"))
            for m in answer):
        found.append(Violation(origin, name, "no assistant turn with non-empty content or tool calls to score"))
    return found


def validate_preference_row(row: Row, schema: dict[str, Any] | None = None,
                            control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Violation]:
    """All contract violations of one preference row (module docstring); empty when valid.
    `control_tokens`: the text no string may hold (contract.py: the template's and tokenizer's)."""
    if row.parse_error is not None:
        return [Violation(row.origin, "<row>", row.parse_error)]
    data, origin = row.data, row.origin
    found = []
    if data.get("messages") is not None:
        found.append(Violation(origin, "messages", "a preference row has prompt/chosen/rejected, not messages"))
    for field in PREFERENCE_FIELDS:
        value = data.get(field)
        if value is None:
            found.append(Violation(origin, field, "missing"))
        elif not isinstance(value, list):
            found.append(Violation(origin, field, f"must be a list of messages, got {type(value).__name__}"))
        elif not value:
            found.append(Violation(origin, field, "is empty"))
    if found:
        return found
    found += _answer_violations(data, origin, "chosen", schema, control_tokens)
    found += _answer_violations(data, origin, "rejected", None, control_tokens)  # the schema is for chosen only
    found = list(dict.fromkeys(found))  # prompt and tools violations come from both checks
    if not found and ([normalize_message(m) for m in data["chosen"]]
                      == [normalize_message(m) for m in data["rejected"]]):
        found.append(Violation(origin, "rejected", "identical to chosen; a pair needs two different answers"))
    return found


def validate_any_rows(rows: Iterable[Row], schema: dict[str, Any] | None = None,
                      control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS
                      ) -> Iterator[tuple[Row, str | None, list[Violation]]]:
    """(row, kind, violations) for rows of either kind; kind is None for an unparsed row.

    The first parsed row of each file fixes that file's kind; a row of the other kind
    in it is a violation (`<row>`), not checked further.
    """
    file_kinds: dict[str, tuple[str, Origin]] = {}
    for row in rows:
        if row.parse_error is not None or not isinstance(row.data, dict):
            kind = None if row.parse_error is not None else "chat"
            yield row, kind, validate_row(row, schema, control_tokens)
            continue
        kind = row_kind(row.data)
        file_kind, first = file_kinds.setdefault(row.origin.path, (kind, row.origin))
        if kind != file_kind:
            yield row, kind, [Violation(row.origin, "<row>", f"a {kind} row in a file of {file_kind} rows (the "
                                        f"first at {first}); one file holds one kind")]
        elif kind == "preference":
            yield row, kind, validate_preference_row(row, schema, control_tokens)
        else:
            yield row, kind, validate_row(row, schema, control_tokens)


def normalize_preference_row(data: dict[str, Any]) -> dict[str, Any]:
    """Canonical form of a valid preference row (as contract.normalize_row for chat rows)."""
    return normalize_fields(data, PREFERENCE_FIELDS)


def check_rows_or_raise(rows: Iterable[Row], schema: dict[str, Any] | None = None, max_shown: int = 10,
                        control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> tuple[str, list[Row]]:
    """Validate rows of either kind; raise ValueError as contract.check_or_raise does,
    else return (kind, the rows normalized). All rows must be of one kind ("chat" when
    there are none)."""
    rows = list(rows)
    violations: list[Violation] = []
    first_of_kind: dict[str, Origin] = {}
    for row, kind, row_violations in validate_any_rows(rows, schema, control_tokens):
        violations += row_violations
        if kind is not None:
            first_of_kind.setdefault(kind, row.origin)
    if violations:
        raise violations_error(violations, max_shown)
    if len(first_of_kind) > 1:
        (first_kind, first), (other_kind, other) = first_of_kind.items()
        raise ValueError(f"{other}: <row>: a {other_kind} row, but the inputs' first row ({first}) is a {first_kind} "
                         "row; one dataset holds one kind")
    kind = next(iter(first_of_kind), "chat")
    normalize = normalize_preference_row if kind == "preference" else normalize_row
    return kind, [Row(normalize(row.data), row.origin) for row in rows]


def check_preferences_or_raise(rows: Iterable[Row], schema: dict[str, Any] | None = None,
                               control_tokens: tuple[str, ...] = GLM5_CONTROL_TOKENS) -> list[Row]:
    """`check_rows_or_raise` for data that must be preference rows; returns them normalized."""
    kind, rows = check_rows_or_raise(rows, schema, control_tokens=control_tokens)
    if rows and kind != "preference":
        raise ValueError(f"{rows[0].origin}: <row>: a chat row (messages) where preference rows "
                         "(prompt/chosen/rejected) are expected")
    return rows


def tokenize_pair(row: dict[str, Any], tokenizer: Any, *, template: str | None = None, enable_thinking: bool = True,
                  name: str | None = None) -> tuple[TokenizedSample, TokenizedSample]:
    """(chosen, rejected) samples of one normalized preference row, labels on the answers only.

    Args:
        row: a contract-normalized preference row.
        tokenizer, template, enable_thinking: as in chat_template.tokenize_conversation.
        name: how errors name the row (its file:line); defaults to its id.

    Raises:
        ValueError: the template renders the prompt differently before the two answers.
    """
    num_prompt_turns = sum(message["role"] == "assistant" for message in row["prompt"])
    samples, prompt_lengths = [], []
    for field in ANSWER_FIELDS:
        sample = tokenize_conversation(row["prompt"] + row[field], tokenizer, tools=row.get("tools") or None,
                                       template=template, loss_on="all_assistant", enable_thinking=enable_thinking)
        # The answer's own turn opening (GLM's <|assistant|>) is prompt (inference writes it); its
        # labels after it are exactly SFT's, and the prompt's assistant turns become context.
        prompt_length = sample.turn_starts[num_prompt_turns]
        labels = [IGNORE_INDEX] * prompt_length + sample.labels[prompt_length:]
        samples.append(TokenizedSample(sample.input_ids, labels))
        prompt_lengths.append(prompt_length)
    chosen, rejected = samples
    length = prompt_lengths[0]
    if length != prompt_lengths[1] or chosen.input_ids[:length] != rejected.input_ids[:length]:
        label = name or f"preference row {row.get('id', '(no id)')}"
        raise ValueError(f"{label}: prompt: the chat template renders the prompt differently before chosen "
                         f"({prompt_lengths[0]} tokens) and before rejected ({prompt_lengths[1]} tokens); "
                         "a pair needs one shared prompt")
    return chosen, rejected
