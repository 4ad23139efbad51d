"""Read chat rows from JSONL, Parquet, or local HF `datasets` directories.

Every row keeps its origin so errors can point at it as `file:line`: the 1-based
line number for JSONL (what editors show), the 0-based row index for Parquet and
`datasets` (what `table[i]` / `ds[i]` take). A JSONL line that is not valid UTF-8 (or
escapes a lone surrogate), or not a JSON object, is still yielded, with `parse_error`
set, so `glmtune data validate` can list it next to the contract violations instead of
stopping at the first bad line (JSONL is read as bytes, one line at a time, so one bad
byte costs one row, not the file). So is a line over MAX_ROW_BYTES (read no further
than that) and a row nested deeper than MAX_JSON_DEPTH (64; a chat row with tool calls
and tool specs uses about 12), which would otherwise raise RecursionError in `json` or
in the checks that walk rows; Parquet and `datasets` rows get the depth check too. A
file that cannot be read at all (a `.parquet` that is not Parquet, a damaged
`datasets` directory) is a ValueError naming it; so is an input that is not a regular file
(a FIFO, a socket, a device, a directory named like a data file, or one inside a `datasets`
directory), refused before anything opens it (`glmtune.io.regular`): a FIFO would block the
read forever.

Row schema (checked by contract.py):
    {"messages": [{"role": "system|user|assistant|tool",
                   "content": str | [{"type": "text", "text": str}],
                   "tool_calls": [{"type": "function", "function": {"name": str, "arguments": {...}}}]
                                 | [{"name": str, "arguments": {...}}],
                   "reasoning_content": str (optional)}],
     "tools": [JSON tool specs] (optional), "group": str (optional), "id": str (optional)}
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from glmtune.io.contained import inside
from glmtune.io.json_file import json_name, read_json_file
from glmtune.io.regular import check_entries, check_regular_file, open_regular
from glmtune.io.text_limits import MAX_JSON_DEPTH, JsonSyntaxError, json_depth, parse_json

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
# Files `datasets.save_to_disk` writes: a Dataset has state.json, a DatasetDict dataset_dict.json.
_HF_MARKERS = ("state.json", "dataset_dict.json")
_HASH_CHUNK = 1 << 20
# A JSON escape of a high or low surrogate: the only way a decoded line can hold text UTF-8 cannot encode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
# One JSONL line, one conversation: 16 MiB holds a million-token conversation (about 4 bytes a
# token, with JSON escapes) with room to spare; a longer line is a broken file, not a row.
MAX_ROW_BYTES = 16 << 20
_MAX_DATASET_JSON_BYTES = 64 << 20  # a `datasets` directory's state.json and dataset_dict.json


@dataclass(frozen=True)
class Origin:
    """Where a row came from: `path` and `line` (see module docstring for numbering)."""

    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Row:
    """One input row. `data` is the parsed object (None when `parse_error` is set)."""

    data: Any
    origin: Origin
    parse_error: str | None = None


def _decode_line(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None), or (None, reason) for a line that is not valid UTF-8."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        # The bytes before the bad one decode, so the column counts characters like JSON's colno.
        column = len(raw[:exc.start].decode("utf-8")) + 1
        return None, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})"


def loads_bounded(text: str) -> Any:
    """`json.loads(text)` within `parse_json`'s depth bound (MAX_JSON_DEPTH).

    A syntax error is json's own JSONDecodeError, so that callers quote its message and
    column in their words; nesting too deep is a ValueError("JSON nested deeper than 64 levels").
    """
    try:
        return parse_json(text, "JSON")
    except JsonSyntaxError as exc:
        raise exc.error from None
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("JSON: ")) from None


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, bool]]:
    """(line, whether it is whole) per line of `f`; a line over MAX_ROW_BYTES is cut there and
    the rest of it skipped unread into memory."""
    while raw := f.readline(MAX_ROW_BYTES + 1):
        if len(raw) <= MAX_ROW_BYTES or raw.endswith(b"\n"):
            yield raw, True
            continue
        while (rest := f.readline(_HASH_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield raw, False


def _read_jsonl(path: Path) -> Iterator[Row]:
    # Bytes, split at b"\n" only: a decode error then names its line, and a stray
    # b"\r" inside a line does not shift the line numbers editors show.
    with open_regular(path, "data file") as f:
        for line_number, (raw, whole) in enumerate(_lines(f), start=1):
            origin = Origin(str(path), line_number)
            if not whole:
                yield Row(None, origin, f"line longer than {MAX_ROW_BYTES:,} bytes (MAX_ROW_BYTES); one line "
                                        "holds one conversation")
                continue
            line, reason = _decode_line(raw)
            if reason is not None:
                yield Row(None, origin, reason)
                continue
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not rows
            try:
                data = loads_bounded(line)
            except json.JSONDecodeError as exc:
                yield Row(None, origin, f"invalid JSON: {exc.msg} (column {exc.colno})")
                continue
            except ValueError as exc:  # nested too deep
                yield Row(None, origin, str(exc))
                continue
            if not isinstance(data, dict):
                yield Row(None, origin, f"expected a JSON object, got {type(data).__name__}")
                continue
            if _SURROGATE_ESCAPE.search(line) and (reason := _lone_surrogate(data)):
                yield Row(None, origin, reason)
                continue
            yield Row(data, origin)


def _lone_surrogate(data: Any) -> str | None:
    """A reason when the parsed row holds a lone surrogate (JSON can escape one, e.g.
    "\\ud800"; nothing downstream can encode it as UTF-8), else None."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode: lone surrogate \\u{ord(exc.object[exc.start]):04x} escaped in a JSON string"
    return None


def _bounded_row(data: Any, origin: Origin) -> Row:
    """A Parquet or `datasets` row, or a parse error when it is nested deeper than a JSONL row may be."""
    if json_depth(data) > MAX_JSON_DEPTH:
        return Row(None, origin, f"nested deeper than {MAX_JSON_DEPTH} levels")
    return Row(data, origin)


def _first_line(exc: BaseException) -> str:
    """An exception's message as one printable line (pyarrow appends context lines, and
    a corrupt page's message can quote raw bytes)."""
    line = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in line)


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_regular_file(path, "data file")  # pyarrow opens it: a FIFO would block there
    index = 0
    try:  # a damaged page can surface only when its batch is read, so the loop is covered too
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for data in batch.to_pylist():
                yield _bounded_row(data, Origin(str(path), index))
                index += 1
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from exc


def _read_hf_dataset(path: Path) -> Iterator[Row]:
    try:
        import datasets  # optional dependency: only needed for save_to_disk directories
    except ModuleNotFoundError as exc:
        raise ValueError(f"{path}: reading a `datasets` directory needs the datasets package "
                         "(pip install datasets)") from exc

    check_entries(path, "`datasets` directory entry", recursive=True)  # datasets opens every file in it
    _check_dataset_listing(path)
    try:
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            parts = [(f"{path}[{split}]", loaded[split]) for split in loaded]
        else:
            parts = [(str(path), loaded)]
        for name, dataset in parts:
            for index, data in enumerate(dataset):
                yield _bounded_row(data, Origin(name, index))
    # Any type: a damaged state.json, dataset_info.json or .arrow file raises KeyError,
    # TypeError, JSONDecodeError, ArrowInvalid or FileNotFoundError from inside datasets.
    except Exception as exc:
        raise ValueError(f"{path}: not a readable `datasets` directory "
                         f"({type(exc).__name__}: {_first_line(exc)})") from exc


def _check_dataset_listing(path: Path) -> None:
    """The files a `datasets` directory's JSON names stay inside it (`glmtune.io.contained`):
    `datasets` joins dataset_dict.json's splits and state.json's `_data_files` to the directory
    unchecked, so `../other/data.arrow` would read another dataset. ValueError naming the file."""
    listing = path / "dataset_dict.json"
    if listing.is_file():
        splits = read_json_file(listing, "`datasets` listing", max_bytes=_MAX_DATASET_JSON_BYTES).get("splits")
        if not isinstance(splits, list):
            raise ValueError(f"`datasets` listing {listing}: splits is {json_name(splits)}, not a list of names")
        directories = [inside(path, split, f"`datasets` listing {listing}: splits", want_dir=True) for split in splits]
    else:
        directories = [path]
    for directory in directories:
        state = directory / "state.json"
        if not state.is_file():
            continue
        files = read_json_file(state, "`datasets` state", max_bytes=_MAX_DATASET_JSON_BYTES).get("_data_files")
        if not (isinstance(files, list) and all(isinstance(entry, dict) for entry in files)):
            raise ValueError(f"`datasets` state {state}: _data_files is {json_name(files)}, not a list of files")
        for entry in files:
            inside(directory, entry.get("filename"), f"`datasets` state {state}: _data_files")


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def expand_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Resolve inputs to readable units: files, and `datasets` directories.

    A plain directory stands for the JSONL and Parquet files directly inside it, in
    sorted order so runs are reproducible.
    """
    units: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"data path not found: {path}")
        if is_hf_dataset_dir(path):
            units.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES)
            if not found:
                raise ValueError(f"{path} holds no .jsonl or .parquet files and is not a `datasets` directory")
            units.extend(check_regular_file(p, "data file") for p in found)
        elif path.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES:
            units.append(check_regular_file(path, "data file"))
        else:
            raise ValueError(f"{path}: unsupported data file (expected .jsonl, .parquet, or a save_to_disk directory)")
    return units


def no_rows_message(paths: Iterable[str | Path]) -> str:
    """The sentence every command gives for an empty dataset, naming the inputs as given."""
    return f"no rows in {', '.join(str(p) for p in paths)} (empty, or only blank lines)"


def read_rows(paths: str | Path | Iterable[str | Path]) -> Iterator[Row]:
    """Yield every row of the given files/directories, in order, with origins."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in expand_inputs(paths):
        if path.is_dir():
            yield from _read_hf_dataset(path)
        elif path.suffix in PARQUET_SUFFIXES:
            yield from _read_parquet(path)
        else:
            yield from _read_jsonl(path)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and contents, sorted)."""
    path = Path(path)
    digest = hashlib.sha256()
    if path.is_dir():
        check_entries(path, "data directory entry", recursive=True)
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        check_regular_file(path, "data file")
        files = [path]
    for file in files:
        if file is not path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open_regular(file, "data file") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def inputs_sha256(paths: Iterable[str | Path]) -> str:
    """One hash over all inputs, in order (a data-version component for caches)."""
    digest = hashlib.sha256()
    for path in expand_inputs(paths):
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def unit_format(path: Path) -> str:
    """"hf_datasets", "parquet" or "jsonl": how `read_rows` reads an expanded input."""
    if path.is_dir():
        return "hf_datasets"
    return "parquet" if path.suffix in PARQUET_SUFFIXES else "jsonl"


def check_format(paths: Iterable[str | Path], expected: str) -> None:
    """With `data.format` set (not "auto"), every input must be of that format."""
    if expected == "auto":
        return
    for unit in expand_inputs(paths):
        if unit_format(unit) != expected:
            raise ValueError(f"{unit}: data.format is {expected!r} but this input is {unit_format(unit)}")
