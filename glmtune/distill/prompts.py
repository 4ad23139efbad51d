"""The prompts a teacher answers, read from a dataset, each with a stable row id.

A row is either
  * a chat row (`messages`, optional `tools`): its prompt is the conversation up to its last
    assistant turn (the whole conversation when it has none), which must end with a user or tool
    turn; or
  * a prompt row: `{"prompt": "...", "system": "..." (optional), "tools": [...] (optional)}`.
Either may carry `id` (a string or integer, unique in the dataset: the output row's id), `group`
and `category` (kept on the output row). Without an `id`, the row id is "p-" and the first 16 hex
digits of the sha256 of the prompt's canonical JSON (messages and tools), with "-2", "-3", ... for
a prompt that repeats: the same dataset gives the same ids, so a rerun knows which rows it did.

The prompt is checked with the data contract as the output row will be (the prompt followed by an
assistant turn): a row that fails is a one-line error naming its file:line, before any request.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmtune.data.contract import check_conversation, normalize_row, violations_error
from glmtune.data.sources import Row, no_rows_message, read_rows

KEPT_FIELDS = ("group", "category")
MAX_PROMPTS = 10_000_000


@dataclass
class Prompt:
    row_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    origin: str  # file:line
    kept: dict[str, Any] = field(default_factory=dict)  # group, category


def _conversation(row: Row) -> tuple[dict[str, Any], str | None]:
    """(the row as a chat row of prompt + placeholder answer, an error)."""
    data = row.data
    if not isinstance(data, dict):
        return {}, "expected an object with `messages` or `prompt`"
    if "messages" in data:
        messages = data["messages"]
        if not isinstance(messages, list):
            return {}, "messages: must be a list"
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=len(messages))
        prompt = messages[:last]
    elif isinstance(data.get("prompt"), str):
        system = data.get("system")
        prompt = ([{"role": "system", "content": system}] if isinstance(system, str) else []) + [
            {"role": "user", "content": data["prompt"]}]
    else:
        return {}, "expected `messages` (a chat row) or `prompt` (a string)"
    if not prompt or not isinstance(prompt[-1], dict) or prompt[-1].get("role") not in ("user", "tool"):
        return {}, "the prompt (the conversation before its last assistant turn) must end with a user or tool turn"
    chat = {key: data[key] for key in ("tools", "id", *KEPT_FIELDS) if data.get(key) is not None}
    chat["messages"] = [*prompt, {"role": "assistant", "content": "answer"}]
    return chat, None


def _row_id(given: Any, messages: list, tools: list | None, seen: Counter) -> str:
    if given is not None:
        return str(given)
    digest = hashlib.sha256(json.dumps({"messages": messages, "tools": tools}, sort_keys=True,
                                       ensure_ascii=False).encode()).hexdigest()[:16]
    seen[digest] += 1
    return f"p-{digest}" + (f"-{seen[digest]}" if seen[digest] > 1 else "")


def read_prompts(paths: list[str | Path]) -> list[Prompt]:
    """Every row's prompt (module docstring); ValueError naming the first bad rows."""
    prompts: list[Prompt] = []
    violations, errors, seen, ids = [], [], Counter(), {}
    for row in read_rows(paths):
        if row.parse_error is not None:
            errors.append(f"{row.origin}: {row.parse_error}")
            continue
        chat, error = _conversation(row)
        found = [] if error else check_conversation(chat, row.origin)
        if error:
            errors.append(f"{row.origin}: {error}")
            continue
        if found:
            violations.extend(found)
            continue
        chat = normalize_row(chat)
        messages, tools = chat["messages"][:-1], chat.get("tools")
        row_id = _row_id(chat.get("id"), messages, tools, seen)
        if row_id in ids:
            errors.append(f"{row.origin}: id {row_id!r} repeats the row at {ids[row_id]}")
            continue
        ids[row_id] = str(row.origin)
        prompts.append(Prompt(row_id, messages, tools, str(row.origin),
                              {key: chat[key] for key in KEPT_FIELDS if key in chat}))
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"more than {MAX_PROMPTS:,} prompts; split the dataset")
    if violations:
        raise violations_error(violations)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(errors[0] + more)
    if not prompts:
        raise ValueError(f"{no_rows_message(paths)}: no prompts to answer")
    return prompts
