"""JSON files read from disk: bounded, type-checked, and every refusal one sentence naming the file.

Run directories, prepared datasets, adapters, caches and reports hold JSON that glmtune wrote
earlier or that a user handed over, and either may have been cut short or edited. `json.loads`
on such a file raises a RecursionError for `[[[[...`, reads a 10 GB file whole, blocks on a
FIFO, and returns a list where the reader expects an object (an AttributeError three calls
later). These readers do it once, for every such file:

  * `read_json_file(path, what)`: a regular file (`regular.open_regular`: a FIFO or a device is
    refused before it is read) of at most `max_bytes`, parsed within `parse_json`'s depth bound,
    and of the kind expected (an object unless told otherwise).
  * `json_lines(path, what)`: a JSON-lines file (`metrics.jsonl`), one bounded line at a time,
    each line a value of the kind expected; with `cut_tail`, a last line cut short by a kill
    (not JSON, no newline after it) ends the file instead of failing it.

Each failure is a ValueError starting with the file (`what` and the path; `path:line` for a line).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from glmtune.io.regular import open_regular
from glmtune.io.text_limits import JsonSyntaxError, parse_json

MAX_JSON_FILE_BYTES = 64 << 20  # a record glmtune writes is kilobytes; a data manifest a few
MAX_JSON_LINE_BYTES = 1 << 20  # one logged step is a few hundred bytes

_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def json_name(value: Any) -> str:
    """The JSON name of a parsed value's kind ("an object", "a list", ...)."""
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _label(path: Path, what: str) -> str:
    return f"{what} {path}" if what else str(path)


def _check_kind(value: Any, kind: type | None, label: str) -> Any:
    if kind is not None and not isinstance(value, kind):
        raise ValueError(f"{label}: is {json_name(value)}, not {_JSON_NAMES.get(kind, kind.__name__)}")
    return value


def read_json_file(path: str | Path, what: str = "", *, max_bytes: int = MAX_JSON_FILE_BYTES,
                   kind: type | None = dict) -> Any:
    """The JSON value in `path` (module docstring); `kind` None takes any JSON value.

    Raises:
        ValueError: not a regular file, over `max_bytes`, not JSON, nested too deep, or not `kind`;
            the message starts with `what` and the path.
        FileNotFoundError: nothing at `path`.
    """
    path, label = Path(path), _label(Path(path), what)
    with open_regular(path, what) as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{label}: more than {max_bytes:,} bytes, not a file glmtune writes here")
    return _check_kind(parse_json(raw, label), kind, label)


def json_lines(path: str | Path, what: str = "", *, max_line_bytes: int = MAX_JSON_LINE_BYTES,
               kind: type | None = dict, cut_tail: bool = False) -> Iterator[tuple[int, Any, bytes]]:
    """(line number, value, the line's bytes without its newline) for each non-blank line of `path`.

    Raises:
        ValueError: naming `path:line`, for a line over `max_line_bytes`, one that is not JSON (but
            a cut last line with `cut_tail`), nested too deep, or not `kind`; or a file that is not
            a regular file.
    """
    path, label = Path(path), _label(Path(path), what)
    with open_regular(path, what) as fh:
        number = 0
        while line := fh.readline(max_line_bytes + 1):
            number += 1
            ended = line.endswith(b"\n")
            if len(line) > max_line_bytes and not (ended and len(line) == max_line_bytes + 1):
                raise ValueError(f"{label}:{number}: a line of more than {max_line_bytes:,} bytes, not a JSON record")
            text = line.rstrip(b"\r\n")
            if not text.strip():
                continue
            try:
                value = parse_json(text, f"{label}:{number}")
            except JsonSyntaxError:
                if cut_tail and not ended:  # the last line, cut short where a killed writer stopped
                    return
                raise
            yield number, _check_kind(value, kind, f"{label}:{number}"), text
