"""Checksums of a training checkpoint's files: recorded at save, verified at resume and export.

Every file of a checkpoint directory (DCP shards and the layout, trainer state, RNG states)
gets its size and sha256 in `checksums.json`, written last, before the directory is renamed
into place. The listing must cover the directory exactly: a file present but not listed, a
file listed but missing, anything that is not a regular file (a link, a directory), a
truncated file and a same-size byte flip are all named in one line, instead of failing deep
inside DCP. So an edited listing cannot wave an edited file through: emptying it, or
dropping a file from it, is refused like the damage it hides. The listing itself is read
with its size and nesting bounded and every entry's type checked (`read_checksums`).

Hashing is split over the ranks (rank r hashes every world_size-th file of the
sorted list) and the results gathered: a checkpoint of N bytes costs each rank
N / world_size bytes of reading, whether saving or verifying.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch.distributed as dist

from glmtune.io.text_limits import parse_json, printable

CHECKSUMS_NAME = "checksums.json"
_CHUNK = 8 << 20
_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A listing of a million files is far past any checkpoint (a few files per rank).
_MAX_LISTING_BYTES = 128 << 20


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value):
    """Every rank's `value`, as a list on every rank (a plain list of one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def file_digest(path: Path) -> dict[str, int | str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _entries(directory: Path) -> list[str]:
    """Every name in `directory` but the listing itself: what the listing must cover."""
    return sorted(p.name for p in directory.iterdir() if p.name != CHECKSUMS_NAME)


def write_checksums(directory: Path) -> None:
    """Collective: hash this rank's share of `directory`'s files; rank 0 writes `checksums.json`.

    Every other file of the checkpoint must be complete on disk before this is called.
    """
    rank, world = _dist()
    files = _entries(directory)  # every rank lists the same directory (a shared filesystem, as DCP needs)
    assert all(_regular(directory / name) for name in files), f"{directory} holds more than files"
    mine = {name: file_digest(directory / name) for name in files[rank::world]}
    merged: dict[str, dict] = {}
    for part in _gather(mine):
        merged.update(part)
    if rank == 0:
        path = directory / CHECKSUMS_NAME
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"version": _VERSION, "files": dict(sorted(merged.items()))}, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())


def has_checksums(directory: Path) -> bool:
    return (directory / CHECKSUMS_NAME).is_file()


def _regular(path: Path) -> bool:
    """A regular file itself, not a link to one (a link could lead anywhere: /dev/zero, another run)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """The listing of `checksums.json`: file name -> {"size", "sha256"}, every field type-checked.

    Raises:
        ValueError: one sentence naming checksums.json and what in it is wrong.
    """
    path = directory / CHECKSUMS_NAME
    if path.stat().st_size > _MAX_LISTING_BYTES:  # before reading it into memory
        raise ValueError(f"{CHECKSUMS_NAME}: {path.stat().st_size:,} bytes, more than any checkpoint's listing")
    value = parse_json(path.read_bytes(), CHECKSUMS_NAME, max_bytes=_MAX_LISTING_BYTES)
    if not isinstance(value, dict) or set(value) != {"version", "files"} or value["version"] != _VERSION:
        raise ValueError(f"{CHECKSUMS_NAME}: not a checksum listing of version {_VERSION} "
                         "(an object of exactly 'version' and 'files')")
    files = value["files"]
    if not isinstance(files, dict):
        raise ValueError(f"{CHECKSUMS_NAME}: 'files' is a {type(files).__name__}, not an object of file names")
    for name, entry in files.items():
        if name in ("", ".", "..", CHECKSUMS_NAME) or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"{CHECKSUMS_NAME}: {_shown(name)} is not the name of a file of the checkpoint")
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or set(entry) != {"size", "sha256"} or type(size) is not int or size < 0
                or not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
            raise ValueError(f"{CHECKSUMS_NAME}: the entry of {_shown(name)} is not {{\"size\": bytes, "
                             "\"sha256\": 64 hex digits}")
    return files


def _listing_problems(directory: Path, recorded: dict[str, dict[str, Any]]) -> list[str]:
    """What the listing leaves out: files present but not listed, entries that are not files."""
    problems = []
    for name in _entries(directory):
        if name not in recorded:
            problems.append(f"{_shown(name)} is in the checkpoint but not in {CHECKSUMS_NAME} (every file of a "
                            "checkpoint is listed: an edited listing, or a file put there afterwards)")
        elif not _regular(directory / name):
            problems.append(f"{_shown(name)} is not a regular file (a link or a directory; a checkpoint holds files)")
    return problems


def _shown(name: str) -> str:
    """A file name as a message shows it: on one line, control characters escaped, not endless."""
    shown = printable(name)
    return shown if len(shown) <= 120 else shown[:117] + "..."


def _file_problem(directory: Path, name: str, expected: dict[str, Any]) -> str | None:
    path = directory / name
    if not os.path.lexists(path):
        return f"{_shown(name)} is missing"
    if not _regular(path):
        return None  # named by `_listing_problems`
    size = path.stat().st_size
    if size != expected["size"]:
        return f"{_shown(name)} is {size} bytes, {expected['size']} were written (truncated or damaged)"
    if file_digest(path)["sha256"] != expected["sha256"]:
        return f"{_shown(name)} does not match its checksum (modified or damaged)"
    return None


def verify_checksums(directory: Path) -> list[str]:
    """Collective: what is wrong with `directory`'s files (empty when intact), on every rank.

    A checkpoint without `checksums.json` (written before checksums existed) cannot be
    verified; callers decide what that means (see `has_checksums`).
    """
    rank, world = _dist()
    problems: list[str] = []
    try:
        recorded = read_checksums(directory)
    except ValueError as exc:  # its messages start with checksums.json
        recorded = None
        if rank == 0:
            problems.append(str(exc))
    except OSError as exc:
        recorded = None
        if rank == 0:
            problems.append(f"{CHECKSUMS_NAME} is unreadable ({exc.strerror or exc})")
    if recorded is not None:
        if rank == 0:
            problems += _listing_problems(directory, recorded)
        for name in sorted(recorded)[rank::world]:
            problem = _file_problem(directory, name, recorded[name])
            if problem:
                problems.append(problem)
    return [p for part in _gather(problems) for p in part]
