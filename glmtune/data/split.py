"""Group-aware, deterministic train/validation/test split.

A row's split depends only on its split key, hashed with a seed: the `group` field
when present (e.g. a customer id), else its `id`, else a hash of its content. All
rows of a group therefore land in the same split, so the model is never evaluated
on a customer, document or conversation family it trained on, and adding rows never
moves existing groups between splits. The achieved ratios are close to the
requested ones only when there are many groups.

A preference row (preferences.py) without a group is split by its prompt (and
tools), never by its id or answers: all pairs of one prompt land in one split, so a
model is never validated on a prompt whose other pairs it trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from glmtune.data.dedup import exact_key
from glmtune.data.preferences import row_kind
from glmtune.data.sources import Row

SPLITS: tuple[str, ...] = ("train", "validation", "test")  # HF datasets split names
DEFAULT_RATIOS: tuple[float, float, float] = (0.9, 0.05, 0.05)


def parse_ratios(text: str) -> tuple[float, float, float]:
    """Parse "0.9,0.05,0.05" (train,validation,test) and check it."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError as exc:
        raise ValueError(f"ratios must be three comma-separated numbers like 0.9,0.05,0.05, got {text!r}") from exc
    return check_ratios(values)


def check_ratios(ratios: tuple[float, ...] | list[float]) -> tuple[float, float, float]:
    if len(ratios) != len(SPLITS):
        raise ValueError(f"need {len(SPLITS)} ratios (train,validation,test), got {len(ratios)}: {ratios}")
    if any(not math.isfinite(r) or r < 0 for r in ratios) or not math.isclose(sum(ratios), 1.0, abs_tol=1e-6):
        raise ValueError(f"ratios must be non-negative and sum to 1, got {ratios}")
    train, validation, test = ratios
    return train, validation, test


def split_key(data: dict[str, Any]) -> str:
    """The identity that decides a row's split (see module docstring)."""
    if data.get("group") is not None:
        return f"group:{data['group']}"
    if row_kind(data) == "preference":
        return f"prompt:{prompt_key(data)}"
    if data.get("id") is not None:
        return f"id:{data['id']}"
    return f"content:{exact_key(data)}"


def prompt_key(data: dict[str, Any]) -> str:
    """sha256 of a preference row's prompt and tools (canonical JSON)."""
    view = {"prompt": data.get("prompt"), "tools": data.get("tools") or None}
    canonical = json.dumps(view, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def assign_split(key: str, ratios: tuple[float, float, float], seed: int = 0) -> str:
    """Map a split key to a split through a uniform hash in [0, 1)."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2.0**64
    cumulative = 0.0
    for name, ratio in zip(SPLITS, ratios):
        cumulative += ratio
        if point < cumulative:
            return name
    return next(name for name, ratio in reversed(list(zip(SPLITS, ratios))) if ratio > 0)  # float rounding at 1.0


def split_rows(rows: list[Row], ratios: tuple[float, float, float] = DEFAULT_RATIOS,
               seed: int = 0) -> dict[str, list[Row]]:
    """Rows per split, each in input order."""
    ratios = check_ratios(ratios)
    out: dict[str, list[Row]] = {name: [] for name in SPLITS}
    for row in rows:
        out[assign_split(split_key(row.data), ratios, seed)].append(row)
    return out
