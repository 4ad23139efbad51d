"""Shared fixtures for the data pipeline tests (tiny tokenizer, JSONL writers)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may reach the hub


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    from glmtune.data.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """write_jsonl(name, rows) -> path; a row that is a str is written verbatim as its line."""

    def write(name: str, rows: list[Any]) -> Path:
        path = tmp_path / name
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("".join(line + "\n" for line in lines))
        return path

    return write
