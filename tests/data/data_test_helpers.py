"""Row builders shared by the data tests (a uniquely named module, not conftest, so
importing it never picks up another test directory's conftest)."""

from __future__ import annotations

from typing import Any


def chat(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    """A row from (role, content) pairs."""
    return {"messages": [{"role": role, "content": content} for role, content in turns], **extra}
