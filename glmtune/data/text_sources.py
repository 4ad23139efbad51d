"""Read raw text documents (`data.kind: text`) from .txt/.md, JSONL and Parquet files, streaming.

Inputs are files or folders; a folder stands for the .txt, .md, .jsonl and .parquet files under it
(recursively, sorted, hidden names skipped), so `data.train: [corpus/]` reads a folder of text.

- `.txt` / `.md`: one document per file, or (`separator`) the pieces between occurrences of a
  stated string, such as a form feed or three newlines;
- `.jsonl`: one document per line, its text in a named field (`text_field`);
- `.parquet`: one document per row, its text in a named column, read row group by row group
  (pyarrow's `iter_batches` with only the columns needed).

A document's source (the unit the split keeps whole: split.py) is its file's path relative to
the folder given (a file given directly: its name), or, with `source_field`, the value of that
key or column. A .txt/.md document is stripped of the whitespace around it (a file's last
newline, a separator's neighbours); a JSONL or Parquet text is taken as it is. Whitespace-only
documents are not documents (skipped).

Memory stays bounded whatever the corpus: files are read a line at a time, each line at most
`max_line_bytes` (a longer line is refused without reading it whole: a 500 MB line with no newline
costs at most that bound), a document at most `max_document_bytes`. Every refusal is one
ValueError naming the file, and the line where there is one: a binary file (a NUL byte), a line
that is not UTF-8, an over-long line or document, a JSONL line that is not an object with a string
text field, a Parquet file without the column.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from glmtune.data.sources import Origin, loads_bounded
from glmtune.io.regular import check_regular_file, open_regular

PLAIN_SUFFIXES = (".txt", ".md")
TEXT_SUFFIXES = (*PLAIN_SUFFIXES, ".jsonl", ".parquet")
# A line is read no further than this: a longer one is a broken or binary file, not prose.
MAX_TEXT_LINE_BYTES = 16 << 20
# A document at most this long (a book is ~1 MB); beyond it, split the file (`separator`).
MAX_TEXT_DOCUMENT_BYTES = 64 << 20
_PARQUET_BATCH_ROWS = 256
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class TextDocument:
    """One document: its text, its source (the split unit) and where it starts."""

    text: str
    source: str
    origin: Origin


@dataclass(frozen=True)
class TextReadOptions:
    text_field: str = "text"
    separator: str | None = None
    source_field: str | None = None
    file_format: str = "auto"  # auto (by suffix), jsonl or parquet
    max_line_bytes: int = MAX_TEXT_LINE_BYTES
    max_document_bytes: int = MAX_TEXT_DOCUMENT_BYTES


def expand_text_inputs(paths: Iterable[str | Path], file_format: str = "auto") -> list[tuple[Path, str]]:
    """(file, its source name) for every input file, folders expanded (module docstring)."""
    units: list[tuple[Path, str]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"data path not found: {path}")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"{path} holds no {', '.join(TEXT_SUFFIXES)} files")
            units += [(check_regular_file(p, "data file"), p.relative_to(path).as_posix()) for p in found]
        elif path.suffix in TEXT_SUFFIXES:
            units.append((check_regular_file(path, "data file"), path.name))
        else:
            raise ValueError(f"{path}: unsupported text file (expected {', '.join(TEXT_SUFFIXES)} or a folder)")
    if file_format != "auto":
        for path, _ in units:
            if path.suffix != f".{file_format}":
                raise ValueError(f"{path}: data.format is {file_format!r} but this input is not a .{file_format} file")
    return units


def _bounded_lines(f: BinaryIO, path: Path, max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) of a file; refusals name the file and the line. A NUL byte
    in the first 8 KiB (where every binary format has one: headers, lengths) is a binary file."""
    if (nul := f.read(_BINARY_SNIFF_BYTES).find(b"\0")) >= 0:
        raise ValueError(f"{path}: a binary file (a NUL byte at offset {nul}), not text")
    f.seek(0)
    for number, raw in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), start=1):
        if len(raw) > max_line_bytes:
            raise ValueError(f"{path}:{number}: a line longer than {max_line_bytes:,} bytes; not a text file "
                             "glmtune reads (break the text into lines)")
        if b"\0" in raw:
            raise ValueError(f"{path}:{number}: a binary file (a NUL byte on this line), not text")
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            column = len(raw[:exc.start].decode("utf-8")) + 1
            raise ValueError(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column})"
                             ) from None


def _read_plain(path: Path, source: str, options: TextReadOptions) -> Iterator[TextDocument]:
    separator = options.separator
    parts: list[str] = []  # the current document's text so far (with a separator: not yet split)
    tail = ""  # its last len(separator) - 1 characters: a separator can straddle two lines
    size, start = 0, 1
    with open_regular(path, "data file") as f:
        for number, line in _bounded_lines(f, path, options.max_line_bytes):
            parts.append(line)
            size += len(line.encode())
            if separator is not None and separator in tail + line:
                *documents, rest = "".join(parts).split(separator)
                for document in documents:
                    if document.strip():
                        yield _plain_document(document, source, path, start)
                    start += document.count("\n") + separator.count("\n")
                parts, size = [rest], len(rest.encode())
            if separator is not None:
                tail = (tail + line)[-(len(separator) - 1):] if len(separator) > 1 else ""
            if size > options.max_document_bytes:
                raise ValueError(f"{path}:{start}: a document longer than {options.max_document_bytes:,} bytes "
                                 "(from this line); split the file (data.text_separator)")
    document = "".join(parts)
    if document.strip():
        yield _plain_document(document, source, path, start)


def _plain_document(text: str, source: str, path: Path, start: int) -> TextDocument:
    """A .txt/.md document without its surrounding whitespace (a file's last newline, a separator's
    neighbours), its line the first of its text."""
    stripped = text.lstrip()
    return TextDocument(stripped.rstrip(), source, Origin(str(path), start + text[:len(text) - len(stripped)].count("\n")))


def _field_text(value: object, field: str, where: str, what: str) -> str:
    if isinstance(value, str):
        return value
    if what == "source" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    kind = "missing" if value is None else f"a {type(value).__name__}"
    raise ValueError(f"{where}: the {what} field {field!r} is {kind}, not a string")


def _read_jsonl(path: Path, source: str, options: TextReadOptions) -> Iterator[TextDocument]:
    with open_regular(path, "data file") as f:
        for number, line in _bounded_lines(f, path, options.max_line_bytes):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = loads_bounded(line)
            except ValueError as exc:  # JSONDecodeError included
                raise ValueError(f"{where}: invalid JSON ({getattr(exc, 'msg', exc)})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
            text = _field_text(data.get(options.text_field), options.text_field, where, "text")
            if options.source_field is not None:
                source = _field_text(data.get(options.source_field), options.source_field, where, "source")
            if text.strip():
                yield TextDocument(text, source, Origin(str(path), number))


def _read_parquet(path: Path, source: str, options: TextReadOptions) -> Iterator[TextDocument]:
    columns = [options.text_field] + ([options.source_field] if options.source_field else [])
    try:
        table = pq.ParquetFile(path)
        missing = [name for name in columns if name not in table.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (columns: {', '.join(table.schema_arrow.names)})")
        index = 0
        for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
            texts = batch.column(options.text_field).to_pylist()
            sources = batch.column(options.source_field).to_pylist() if options.source_field else None
            for k, text in enumerate(texts):
                where = f"{path}:{index}"
                text = _field_text(text, options.text_field, where, "text")
                if sources is not None:
                    source = _field_text(sources[k], options.source_field, where, "source")
                if text.strip():
                    yield TextDocument(text, source, Origin(str(path), index))
                index += 1
    except (pa.ArrowException, OSError) as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ValueError(f"{path}: not a readable Parquet file ({first})") from None


def read_documents(paths: Iterable[str | Path], options: TextReadOptions = TextReadOptions()
                   ) -> Iterator[TextDocument]:
    """Every document of the inputs, in order (files sorted within a folder), streamed."""
    for path, source in expand_text_inputs(paths, options.file_format):
        if path.suffix in PLAIN_SUFFIXES:
            yield from _read_plain(path, source, options)
        elif path.suffix == ".jsonl":
            yield from _read_jsonl(path, source, options)
        else:
            yield from _read_parquet(path, source, options)


def no_documents_message(paths: Iterable[str | Path]) -> str:
    """The sentence for an empty corpus, naming the inputs as given."""
    return f"no documents in {', '.join(str(p) for p in paths)} (empty, or only whitespace)"
