"""Exact and normalized-text deduplication of chat rows.

Both keys cover only what training sees (messages and tools), not `id`/`group`
metadata: two rows with the same conversation are duplicates whatever they are
called. The normalized key lowercases, removes punctuation and collapses
whitespace, so rows that differ only in casing, spacing or punctuation count as
duplicates too. The first occurrence (input order) is kept, which makes the result
independent of anything but the input.

`glmtune data prepare` drops both kinds; `glmtune train` drops exact duplicates only,
since rows that match only after normalization can differ in what the model learns
(the casing or punctuation of an answer) and a recipe trains on its data as given.

Preference rows (preferences.py) are keyed by (prompt, chosen, rejected) and their
tools: the same prompt with another pair of answers is another row, and so is the
same pair with chosen and rejected swapped. Their normalized key normalizes the prompt
only; the answers count exactly, since what makes one answer preferred is often
punctuation (a JSON answer against the same text in single quotes).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from glmtune.data.preferences import ANSWER_FIELDS, PREFERENCE_FIELDS, row_kind
from glmtune.data.sources import Row

_PUNCTUATION = re.compile(r"[^\w\s]|_")


def _training_view(data: dict[str, Any]) -> dict[str, Any]:
    if row_kind(data) == "preference":
        return {**{field: data.get(field) for field in PREFERENCE_FIELDS}, "tools": data.get("tools") or None}
    return {"messages": data.get("messages"), "tools": data.get("tools") or None}


def exact_key(data: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys) of the row's messages and tools."""
    canonical = json.dumps(_training_view(data), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation, collapse whitespace."""
    return " ".join(_PUNCTUATION.sub("", text.lower()).split())


def _message_parts(messages: list[dict[str, Any]]) -> list[str]:
    parts = []
    for message in messages:
        parts.append(f"{message.get('role')} {message.get('content') or ''} {message.get('reasoning_content') or ''}")
        for call in message.get("tool_calls") or []:
            parts.append(json.dumps(call, sort_keys=True, ensure_ascii=False))
    return parts


def normalized_key(data: dict[str, Any]) -> str:
    """sha256 of the normalized text of every message (role included) and the tools;
    for a preference row, of its normalized prompt and tools and its exact answers."""
    preference = row_kind(data) == "preference"
    parts = _message_parts(data.get("prompt" if preference else "messages") or [])
    if data.get("tools"):
        parts.append(json.dumps(data["tools"], sort_keys=True, ensure_ascii=False))
    text = normalize_text("\n".join(parts))
    if preference:  # answers exactly: their punctuation is often what was preferred (valid JSON or not)
        answers = {field: data.get(field) for field in ANSWER_FIELDS}
        text += "\0" + json.dumps(answers, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class DedupStats:
    num_exact_duplicates: int = 0
    num_normalized_duplicates: int = 0


def dedup_rows(rows: list[Row], normalized: bool = True) -> tuple[list[Row], DedupStats]:
    """Drop exact duplicates, then (unless `normalized` is False) normalized-text
    duplicates; keeps first occurrences.

    Rows must be contract-normalized (text content), so equivalent encodings of the
    same conversation (text parts vs string, JSON-string arguments) compare equal.
    """
    stats = DedupStats()
    seen_exact: set[str] = set()
    seen_normalized: set[str] = set()
    kept = []
    for row in rows:
        key = exact_key(row.data)
        if key in seen_exact:
            stats.num_exact_duplicates += 1
            continue
        seen_exact.add(key)
        if normalized:
            key = normalized_key(row.data)
            if key in seen_normalized:
                stats.num_normalized_duplicates += 1
                continue
            seen_normalized.add(key)
        kept.append(row)
    return kept, stats
