"""Untrusted text made safe to print, to use as a file name, and to parse as JSON.

Three places where a string that a user, a data file or a model wrote meets something
that would otherwise act on it:

  * `printable(text)`: a terminal. ANSI escapes and other control characters in a
    manifest field, an `--approved-by` value or a model's output would move the cursor,
    recolour or erase lines (a forged green "ok" is one `\\x1b[32m` away); they are shown
    escaped (`\\x1b`), with newline and tab kept only where the caller allows.
  * `safe_name(value, what)`: a path. Suite, set and model names become directory and
    file names; a name with a separator, `..`, or nothing in it would write outside the
    directory meant for it, so it is refused in one line naming the field.
  * `parse_json(text, what, ...)`: a parser. A model's output or a data row nested
    thousands deep would raise RecursionError deep inside `json`; size and depth are
    bounded, and so (when the caller gives a budget) is what the parse builds: `[{},{},...]`
    turns 3 bytes into a 64-byte dict, so 16 MiB of it would take ~0.4 GB. A string holding
    a lone surrogate (`"\\ud800"`: valid JSON grammar, but text UTF-8 cannot encode, so a
    tokenizer or a file write would fail on it later) is refused, and so, on request, are
    NaN and infinite numbers and duplicate keys. A violation is a ValueError naming `what`.
  * `clipped(value, limit)`: a message. What a server or a file said, quoted in an error
    (a listing of 200,001 model ids), is cut to `limit` characters on one line.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from typing import Any

# C0 and C1 controls, DEL, the Unicode line/paragraph separators, and the bidi overrides,
# isolates and marks that reorder what a terminal shows.
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
# Lone surrogates (U+D800-U+DFFF) too: a str can hold one (a JSON escape, a surrogateescape'd
# name) and any UTF-8 encoder (a terminal, a file) fails on it.
_SURROGATES = "\ud800-\udfff"
_UNSAFE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029{_BIDI}{_SURROGATES}]")
_UNSAFE_NO_LINES = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{_BIDI}{_SURROGATES}]")

MAX_JSON_DEPTH = 64


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: Any, *, multiline: bool = False) -> str:
    """`text` (any value, via str) with every control character shown as an escape.

    With `multiline`, newlines and tabs pass through (a rendered table or report);
    otherwise they are escaped too, so one field stays on one line.
    """
    pattern = _UNSAFE if multiline else _UNSAFE_NO_LINES
    return pattern.sub(_escape, str(text))


def safe_name(value: Any, what: str) -> str:
    """`value` if it can be one file or directory name, else ValueError naming `what`.

    Refused: not a string, empty, `.` or `..`, a path separator (either slash), a NUL
    or other control character, a leading `-` or `~` (read as an option or a home
    directory by whoever types the path), or over 128 characters.
    """
    if not isinstance(value, str):
        raise ValueError(f"{what}: must be a name (a string), got {type(value).__name__}")
    reason = None
    if value.strip() in ("", ".", ".."):
        reason = "is empty or a relative directory"
    elif "/" in value or "\\" in value:
        reason = "contains a path separator"
    elif any(unicodedata.category(ch).startswith("C") for ch in value):
        reason = "contains a control character"
    elif value[0] in "-~":
        reason = f"starts with {value[0]!r}"
    elif len(value) > 128:
        reason = f"is {len(value)} characters long (at most 128)"
    if reason:
        raise ValueError(f"{what}: {printable(value)!r} {reason}; it becomes a file name, so use letters, "
                         "digits, '-', '_' and '.'")
    return value


def _children(value: Any) -> Any:
    return value.values() if isinstance(value, dict) else value


def _walk(value: Any, finite: bool) -> tuple[int, float | None]:
    """(nesting depth of a parsed JSON value, a scalar being 0; with `finite`, its first float
    that is NaN or infinite, else None). One iterator per open container and nothing per
    element: 16 MiB of `[0,0,...]` costs the walk no memory."""
    if not isinstance(value, (dict, list)):
        return 0, value if finite and isinstance(value, float) and not math.isfinite(value) else None
    deepest, stack = 1, [iter(_children(value))]
    while stack:
        for child in stack[-1]:
            if isinstance(child, (dict, list)):
                deepest = max(deepest, len(stack) + 1)
                stack.append(iter(_children(child)))
                break
            if finite and isinstance(child, float) and not math.isfinite(child):
                return deepest, child
        else:
            stack.pop()
    return deepest, None


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion (nor any memory
    per element)."""
    return _walk(value, finite=False)[0]


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) of a parsed JSON value holding a surrogate code point;
    json turns an escaped pair into one character, so any left is a lone one."""
    stack = [iter([value])]
    while stack:
        for child in stack[-1]:
            if isinstance(child, dict):
                stack.append(iter(child.items()))
                break
            if isinstance(child, (list, tuple)):  # a list, or a dict's (key, value)
                stack.append(iter(child))
                break
            if isinstance(child, str) and (found := _SURROGATE.search(child)):
                return found.group(0)
        else:
            stack.pop()
    return None


class JsonSyntaxError(ValueError):
    """Text that is not JSON; `error` is json's own JSONDecodeError (its `msg`, `lineno`, `colno`),
    for callers that say where in their own words or take such text as plain text."""

    def __init__(self, message: str, error: json.JSONDecodeError):
        super().__init__(message)
        self.error = error


class _Refused(ValueError):
    """Raised inside json.loads by a hook; parse_json names `what` in front of it."""


# The containers any text may hold, whatever its size, under a caller's budget
# (`parse_json(bytes_per_container=...)`): 65,536 of them take ~4 MiB.
MIN_CONTAINERS = 65_536
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes and all
_SURROGATE = re.compile(f"[{_SURROGATES}]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _containers_over(text: str, allowed: int) -> int | None:
    """How many arrays and objects a parse of `text` can build, when more than `allowed`: its `[`
    and `{` outside strings. Counted whole first (cheap); only when that count is over are the
    strings' own taken off, string by string (no copy of the text). An upper bound for text that
    is not JSON too: what json builds before its error is a valid prefix, whose strings are
    found exactly."""
    found = text.count("[") + text.count("{")
    if found <= allowed:
        return None
    for string in _STRING.finditer(text):
        start, end = string.span()
        found -= text.count("[", start, end) + text.count("{", start, end)
    return found if found > allowed else None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _Refused(f"key {clipped(twice, 60)!r} given twice")
    return value


def _decoded(text: str | bytes) -> str:
    """`text` as a str: bytes in the encoding json detects (UTF-8, -16 or -32; a BOM allowed),
    strictly, so bytes cannot smuggle in a lone surrogate as json's own `surrogatepass` would."""
    return text if isinstance(text, str) else text.decode(json.detect_encoding(text))


def parse_json(text: str | bytes, what: str, *, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH,
               bytes_per_container: int | None = None, allow_nan: bool = True, unique_keys: bool = False) -> Any:
    """`json.loads(text)` with its size and nesting bounded; ValueError naming `what` otherwise:
    `JsonSyntaxError` for text that is not JSON, a plain ValueError for JSON over the bounds,
    bytes that are not UTF-8 (or -16/-32) and a string holding a lone surrogate.

    `bytes_per_container`: refuse, before parsing, text with more than
    max(MIN_CONTAINERS, len(text) // bytes_per_container) arrays and objects (what a parse builds
    beyond its text: a container costs 56-64 bytes, a scalar at most ~16 x its bytes).
    `allow_nan` False: refuse NaN, Infinity and numbers out of float range (1e999); `unique_keys`:
    refuse an object that gives a key twice (json keeps the last)."""
    if max_bytes is not None and len(text) > max_bytes:
        raise ValueError(f"{what}: {len(text):,} bytes of JSON, more than the {max_bytes:,} allowed")
    try:
        decoded = _decoded(text)
    except ValueError as exc:  # UnicodeDecodeError
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    if bytes_per_container is not None:
        allowed = max(MIN_CONTAINERS, len(text) // bytes_per_container)
        if (found := _containers_over(decoded, allowed)) is not None:
            raise ValueError(f"{what}: {found:,} JSON arrays and objects in {len(text):,} bytes, more than the "
                             f"{allowed:,} allowed (one per {bytes_per_container} bytes)")
    try:
        value = json.loads(decoded, object_pairs_hook=_unique_keys if unique_keys else None)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(f"{what}: not valid JSON ({exc})", exc) from None
    except _Refused as exc:
        raise ValueError(f"{what}: {exc}") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    depth, number = _walk(value, finite=not allow_nan)
    if depth > max_depth:
        raise ValueError(f"{what}: JSON nested deeper than {max_depth} levels")
    if number is not None:
        raise ValueError(f"{what}: a number that is not finite ({number!r}: NaN, Infinity or beyond a float, "
                         "such as 1e999); JSON has none")
    # Cheap tests first: an escape of one, or one in a str given (bytes were decoded strictly); then the strings.
    if (_SURROGATE_ESCAPE.search(decoded) or isinstance(text, str) and not text.isascii()
            and _SURROGATE.search(text)) and (char := _lone_surrogate(value)):
        raise ValueError(f"{what}: not valid Unicode: lone surrogate \\u{ord(char):04x} escaped in a JSON string")
    return value


def clipped(value: Any, limit: int = 200) -> str:
    """`value` (via str) as a message may quote it when someone else wrote it (a server's answer, a
    row): on one line (runs of whitespace as one space), control characters escaped (`printable`),
    at most `limit` characters; a longer one is cut and says how long it was."""
    text = str(value)
    flat = printable(" ".join(text[:4 * limit].split()))
    if len(text) <= limit and len(flat) <= limit:
        return flat
    return f"{flat[:limit]}… ({len(text):,} characters)"
