"""The teacher's top-K log-probabilities per generated token: a compact, append-only binary sidecar.

`glmtune distill generate --top-logprobs K` writes one record per answered row; the distillation
loss reads them back by the row's id. A sidecar is a directory of three files:

  header.json    {"format": "glmtune-topk", "version": 1, "k": K, "vocab_size": V or null,
                 "logprob_dtype": "float32" | "float16"}, written once (atomically) at creation.
  records.bin    the records, back to back, little-endian, no padding. A record of n positions
                 (`glmtune distill generate` writes one per token training supervises in the row's
                 last assistant turn, in order: distill/align.py) is
                     generated  int32[n]      the token the teacher emitted there (-1: not the teacher's)
                     ids        int32[n, K]   its top-K token ids, row-major (-1: no entry)
                     logprobs   dtype[n, K]   their log-probabilities (-inf where the id is -1)
                 i.e. n * (4 + K * (4 + itemsize)) bytes.
  index.jsonl    one line per complete record: {"row": ROW_ID, "offset": BYTES, "n": n, "crc32": CRC}
                 (integers and a string: no floats in JSON), CRC being zlib.crc32 of the record's bytes.

An engine that returns fewer than K alternatives at a position fills the rest with id -1 and
log-prob -inf (exp(-inf) = 0: a consumer that sums probabilities needs no mask; one that gathers
by id must mask `ids < 0`). Log-probs are finite numbers <= 0 otherwise; NaN, +inf, a positive
value, an id outside [0, vocab_size) or an id of -1 with a finite log-prob is refused at `append`
(ValueError): a malformed teacher answer never reaches the file.

Durability: `append` writes the record, flushes and fsyncs records.bin, and only then appends and
fsyncs the record's index line, so every index line names bytes already on disk. A writer killed
at any instant leaves at most a torn last index line and/or bytes past the last indexed record:
`TopKReader` ignores both (a prefix of the rows), and a `TopKWriter` reopened on the directory
truncates them away (checking the last record's CRC) and appends after the last complete record.
An index line that is torn anywhere but at the end, offsets that do not follow each other, or a
CRC that does not match is corruption, not a kill: a ValueError naming the file and line.

A row id appears once: appending it again is a ValueError. `drop_trailing(keep)` removes the last
records whose ids are not in `keep` (a resumed generation whose row was stored here but not yet
in its rows file when it was killed).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glmtune.io.json_file import read_json_file
from glmtune.io.regular import open_regular
from glmtune.io.text_limits import JsonSyntaxError, parse_json

FORMAT = "glmtune-topk"
VERSION = 1
HEADER, RECORDS, INDEX = "header.json", "records.bin", "index.jsonl"
LOGPROB_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
MAX_K = 1024  # engines cap K at 20 (vLLM's default max_logprobs) or a few hundred when raised
MAX_ROW_ID_CHARS = 512
_INT = np.dtype("<i4")
__all__ = ["TopKReader", "TopKWriter", "read_header"]


@dataclass(frozen=True)
class _Entry:
    offset: int
    n: int
    crc32: int
    line_end: int = 0  # the byte after its index line


def _record_bytes(n: int, k: int, itemsize: int) -> int:
    return n * (_INT.itemsize + k * (_INT.itemsize + itemsize))


def read_header(directory: str | Path) -> dict[str, Any]:
    """The sidecar's header, checked; ValueError naming the file otherwise."""
    path = Path(directory) / HEADER
    header = read_json_file(path, "top-K sidecar header")
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} version {VERSION} header")
    k, vocab = header.get("k"), header.get("vocab_size")
    if type(k) is not int or not 1 <= k <= MAX_K:
        raise ValueError(f"{path}: k {k!r} is not an integer from 1 to {MAX_K}")
    if vocab is not None and (type(vocab) is not int or vocab < 1):
        raise ValueError(f"{path}: vocab_size {vocab!r} is not a positive integer or null")
    if header.get("logprob_dtype") not in LOGPROB_DTYPES:
        raise ValueError(f"{path}: logprob_dtype {header.get('logprob_dtype')!r} is not one of "
                         f"{', '.join(LOGPROB_DTYPES)}")
    return header


def _parse_index(directory: Path, k: int, itemsize: int) -> tuple[dict[str, _Entry], list[str], int, int]:
    """(row id -> entry, row ids in order, bytes of the complete index lines, end of the last record)
    of the records complete on disk (module docstring: a torn tail is dropped, corruption refused)."""
    index_path, data_size = directory / INDEX, (directory / RECORDS).stat().st_size
    raw = open_regular(index_path, "top-K sidecar index").read()
    entries: dict[str, _Entry] = {}
    order: list[str] = []
    kept = end = 0
    lines = raw.split(b"\n")
    for number, line in enumerate(lines[:-1], 1):  # the part after the last newline is torn (or empty)
        where = f"{index_path}:{number}"
        entry, row = _index_entry(line, where)
        size = _record_bytes(entry.n, k, itemsize)
        if entry.offset != end:
            raise ValueError(f"{where}: record at byte {entry.offset:,}, expected {end:,} (the file is corrupt)")
        if entry.offset + size > data_size:
            if number == len(lines) - 1:  # only the last line can name bytes a crash lost (power, not a kill)
                break
            raise ValueError(f"{where}: record past the end of {RECORDS} ({data_size:,} bytes): the file is corrupt")
        if row in entries:
            raise ValueError(f"{where}: row {row!r} stored twice (the file is corrupt)")
        kept += len(line) + 1
        entries[row] = _Entry(entry.offset, entry.n, entry.crc32, kept)
        order.append(row)
        end = entry.offset + size
    return entries, order, kept, end


def _index_entry(line: bytes, where: str) -> tuple[_Entry, str]:
    try:
        value = parse_json(line, where)
    except JsonSyntaxError:
        raise ValueError(f"{where}: not a JSON index line (the file is corrupt)") from None
    if not isinstance(value, dict) or set(value) != {"row", "offset", "n", "crc32"}:
        raise ValueError(f"{where}: not an index line {{row, offset, n, crc32}}")
    row, offset, n, crc = value["row"], value["offset"], value["n"], value["crc32"]
    if not isinstance(row, str) or any(type(v) is not int or v < 0 for v in (offset, n, crc)):
        raise ValueError(f"{where}: row must be a string and offset, n, crc32 non-negative integers")
    return _Entry(offset, n, crc), row


class TopKReader:
    """Read a sidecar (module docstring): `get(row_id)` -> (ids int64 [n, k], logprobs float32 [n, k])."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        header = read_header(self.path)
        self.k: int = header["k"]
        self.vocab_size: int | None = header["vocab_size"]
        self.logprob_dtype = LOGPROB_DTYPES[header["logprob_dtype"]]
        self._entries, self.row_ids, _, self._end = _parse_index(self.path, self.k, self.logprob_dtype.itemsize)
        self._data = np.memmap(self.path / RECORDS, dtype=np.uint8, mode="r") if self._end else None

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._entries

    def __len__(self) -> int:
        return len(self.row_ids)

    def _arrays(self, row_id: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        entry = self._entries.get(row_id)
        if entry is None:
            raise KeyError(f"{self.path}: no top-K record for row {row_id!r}")
        size = _record_bytes(entry.n, self.k, self.logprob_dtype.itemsize)
        record = np.asarray(self._data[entry.offset:entry.offset + size]) if size else np.empty(0, np.uint8)
        if zlib.crc32(record.tobytes()) != entry.crc32:
            raise ValueError(f"{self.path / RECORDS}: row {row_id!r}: the record's CRC does not match its index "
                             "line (the file is corrupt)")
        n, k = entry.n, self.k
        generated = record[:n * 4].view(_INT)
        ids = record[n * 4:n * 4 * (k + 1)].view(_INT).reshape(n, k)
        logprobs = record[n * 4 * (k + 1):].view(self.logprob_dtype).reshape(n, k)
        return generated, ids, logprobs

    def get(self, row_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's top-K ids (int64 [n, k], -1 where none) and log-probs (float32 [n, k], -inf there)."""
        _, ids, logprobs = self._arrays(row_id)
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logprobs.astype(np.float32))

    def generated(self, row_id: str) -> torch.Tensor:
        """The tokens the teacher emitted at the row's positions (int64 [n]; -1 where not recorded)."""
        return torch.from_numpy(self._arrays(row_id)[0].astype(np.int64))


def _as_array(value: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(value), dtype=dtype) if value is not None else None


class TopKWriter:
    """Append records to a sidecar (module docstring); a context manager. Reopening a directory this
    class wrote resumes it after its last complete record."""

    def __init__(self, path: str | Path, k: int, vocab_size: int | None = None, *,
                 logprob_dtype: str = "float32") -> None:
        if type(k) is not int or not 1 <= k <= MAX_K:
            raise ValueError(f"top-K sidecar: k {k!r} must be an integer from 1 to {MAX_K}")
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
            raise ValueError(f"top-K sidecar: vocab_size {vocab_size!r} must be a positive integer")
        if logprob_dtype not in LOGPROB_DTYPES:
            raise ValueError(f"top-K sidecar: logprob_dtype {logprob_dtype!r} is not one of {', '.join(LOGPROB_DTYPES)}")
        self.path, self.k, self.vocab_size = Path(path), k, vocab_size
        self.logprob_dtype = LOGPROB_DTYPES[logprob_dtype]
        self._lock = threading.Lock()
        header = {"format": FORMAT, "version": VERSION, "k": k, "vocab_size": vocab_size,
                  "logprob_dtype": logprob_dtype}
        if (self.path / HEADER).exists():
            self._check_same(header)
        else:
            self._create(header)
        self._entries, self.row_ids, index_bytes, self._end = _parse_index(self.path, k, self.logprob_dtype.itemsize)
        self._check_last_crc()
        self._data = open(self.path / RECORDS, "r+b")  # noqa: SIM115 - held until close()
        self._index = open(self.path / INDEX, "r+b")  # noqa: SIM115
        self._data.truncate(self._end)  # a killed writer's record past the index, or its torn line
        self._index.truncate(index_bytes)
        self._data.seek(self._end)
        self._index.seek(index_bytes)
        _fsync_all(self._data, self._index)

    def _create(self, header: dict[str, Any]) -> None:
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise ValueError(f"{self.path}: exists and is not a top-K sidecar (no {HEADER}); not overwritten")
        self.path.mkdir(exist_ok=True)
        for name in (RECORDS, INDEX):
            (self.path / name).touch()
        tmp = self.path / f".{HEADER}.tmp"
        tmp.write_text(json.dumps(header) + "\n", encoding="utf-8")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / HEADER)  # written last: a directory with a header is complete
        _fsync_dir(self.path)

    def _check_same(self, header: dict[str, Any]) -> None:
        stored = read_header(self.path)
        for key in ("k", "vocab_size", "logprob_dtype"):
            if stored[key] != header[key]:
                raise ValueError(f"{self.path / HEADER}: written with {key} {stored[key]!r}, not {header[key]!r}; "
                                 "a sidecar holds one kind of record")

    def _check_last_crc(self) -> None:
        if self.row_ids:
            TopKReader(self.path)._arrays(self.row_ids[-1])  # ValueError when the last record is not intact

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._entries

    def __enter__(self) -> TopKWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def append(self, row_id: str, token_ids: Any, logprobs: Any, *, generated: Any = None) -> None:
        """Store the row's [n, k] top-K ids and log-probs (and the [n] tokens the teacher emitted);
        ValueError for values the module docstring refuses or a row id already stored."""
        ids = _as_array(token_ids, _INT)
        values = _as_array(logprobs, np.float64)
        self._check(row_id, ids, values)
        emitted = np.full(ids.shape[0], -1, _INT) if generated is None else _as_array(generated, _INT)
        if emitted.shape != (ids.shape[0],):
            raise ValueError(f"row {row_id!r}: generated has shape {tuple(emitted.shape)}, expected ({ids.shape[0]},)")
        # float16 stops at -65504: a finite log-prob below it is stored as that, never as -inf (no entry)
        finite_min = float(np.finfo(self.logprob_dtype).min)
        stored = np.where(np.isneginf(values), values, np.maximum(values, finite_min)).astype(self.logprob_dtype)
        record = emitted.tobytes() + ids.tobytes() + stored.tobytes()
        with self._lock:
            if row_id in self._entries:
                raise ValueError(f"{self.path}: row {row_id!r} is already stored")
            self._data.write(record)
            self._data.flush()
            os.fsync(self._data.fileno())  # the bytes first: an index line never names bytes not on disk
            offset, crc = self._end, zlib.crc32(record)
            line = json.dumps({"row": row_id, "offset": offset, "n": ids.shape[0], "crc32": crc}).encode() + b"\n"
            self._index.write(line)
            self._index.flush()
            os.fsync(self._index.fileno())
            self._entries[row_id] = _Entry(offset, ids.shape[0], crc, self._index.tell())
            self.row_ids.append(row_id)
            self._end += len(record)

    def _check(self, row_id: str, ids: np.ndarray, values: np.ndarray) -> None:
        if not isinstance(row_id, str) or not 0 < len(row_id) <= MAX_ROW_ID_CHARS:
            raise ValueError(f"top-K row id {row_id!r}: a string of 1 to {MAX_ROW_ID_CHARS} characters")
        if ids.ndim != 2 or ids.shape[1] != self.k or values.shape != ids.shape:
            raise ValueError(f"row {row_id!r}: ids {tuple(ids.shape)} and logprobs {tuple(values.shape)} must both "
                             f"be [n, {self.k}]")
        missing = ids == -1
        if np.isnan(values).any() or (values > 0).any():
            raise ValueError(f"row {row_id!r}: a log-prob that is NaN or above 0")
        if (ids < -1).any() or (self.vocab_size is not None and (ids >= self.vocab_size).any()):
            raise ValueError(f"row {row_id!r}: a token id outside [0, {self.vocab_size}) (-1 marks no entry)")
        if (np.isneginf(values) != missing).any():
            raise ValueError(f"row {row_id!r}: id -1 (no entry) and log-prob -inf must come together")

    def drop_trailing(self, keep: Container[str]) -> int:
        """Remove the last records whose row ids are not in `keep` (stopping at the first that is);
        how many were removed."""
        with self._lock:
            dropped = 0
            while self.row_ids and self.row_ids[-1] not in keep:
                row = self.row_ids.pop()
                self._end = self._entries.pop(row).offset
                dropped += 1
            if dropped:  # the kept index lines are a prefix of the file: truncating it is the whole edit
                index_end = self._entries[self.row_ids[-1]].line_end if self.row_ids else 0
                self._index.truncate(index_end)
                self._index.seek(index_end)
                self._data.truncate(self._end)
                self._data.seek(self._end)
                _fsync_all(self._index, self._data)
            return dropped

    def close(self) -> None:
        with self._lock:
            for fh in (self._data, self._index):
                if not fh.closed:
                    fh.close()


def _fsync_all(*files) -> None:
    for fh in files:
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
