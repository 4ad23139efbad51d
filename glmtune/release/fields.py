"""Typed reads of an untrusted JSON record (a release manifest given to `release diff`).

A manifest is a file anyone can edit: a list where a dict belongs, a string where a number
belongs, or a null inside a list would otherwise surface as an AttributeError or TypeError
deep inside the code that reads it. Every read goes through a `Fields` view instead:

    fields = Fields(manifest, "release A a.json")
    fields.dict("eval").list("scores")[0].number("threshold")

A missing field or a null reads as empty (an older manifest may lack a section); a field of
the wrong type is one ValueError naming the record and the field's path, e.g.
`release A a.json: eval.scores[2].values is a list, expected an object`.
"""

from __future__ import annotations

from typing import Any

_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type ("an object", "a list", ...)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


class Fields:
    """A view of one JSON object: each read checks the type of what it returns."""

    def __init__(self, value: Any, where: str, path: str = ""):
        self.where, self.path = where, path
        self.value = {} if value is None else value
        if not isinstance(self.value, dict):
            self._wrong(path, value, "an object")

    def _wrong(self, path: str, value: Any, expected: str):
        raise ValueError(f"{self.where}: {path or 'the record'} is {json_type(value)}, expected {expected}")

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str) -> Any:
        """The value as parsed, any JSON type (compared and shown whole, never read into)."""
        return self.value.get(key)

    def dict(self, key: str) -> Fields:
        """The object at `key` (empty when missing or null)."""
        return Fields(self.value.get(key), self.where, self._at(key))

    def list(self, key: str) -> list[Fields]:
        """The list of objects at `key` (empty when missing or null)."""
        items = self.value.get(key)
        if items is None:
            return []
        if not isinstance(items, list):
            self._wrong(self._at(key), items, "a list")
        return [Fields(item, self.where, f"{self._at(key)}[{i}]") if isinstance(item, dict)
                else self._wrong(f"{self._at(key)}[{i}]", item, "an object") for i, item in enumerate(items)]

    def str(self, key: str, required: bool = False) -> str | None:
        """The string at `key` (None when missing or null, unless `required`)."""
        return self._typed(key, (str,), "a string", required)

    def number(self, key: str, required: bool = False) -> int | float | None:
        """The number at `key` (a boolean is not one; None when missing or null, unless `required`)."""
        return self._typed(key, (int, float), "a number", required)

    def scalar(self, key: str) -> str | int | float | bool | None:
        """A string, number, boolean or null at `key` (what a table shows in one cell)."""
        return self._typed(key, (str, int, float, bool), "a string, a number, a boolean or null", False)

    def _typed(self, key: str, types: tuple, expected: str, required: bool):
        value = self.value.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            self._wrong(self._at(key), value, expected)
        return value

    def items(self) -> list[tuple[str, Any]]:
        """(key, value) pairs of this object, values any JSON type."""
        return list(self.value.items())
