"""Checksums of a training checkpoint's files: recorded at save, verified at resume.

Every file of a checkpoint directory (DCP shards and `.metadata`, trainer state,
RNG states) gets its size and sha256 in `checksums.json`, written last, before the
directory is renamed into place. A truncated file, a missing file and a same-size
byte flip all show as a mismatch, so a damaged checkpoint is named in one line
instead of failing deep inside DCP or unpickling.

Hashing is split over the ranks (rank r hashes every world_size-th file of the
sorted list) and the results gathered: a checkpoint of N bytes costs each rank
N / world_size bytes of reading, whether saving or verifying.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

CHECKSUMS_NAME = "checksums.json"
_CHUNK = 8 << 20


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


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS_NAME)


def write_checksums(directory: Path) -> None:
    """Collective: hash this rank's share of `directory`'s files; rank 0 writes `checksums.json`.

    Every other file of the checkpoint must be complete on disk before this is called.
    """
    rank, world = _dist()
    files = _files(directory)  # every rank lists the same directory (a shared filesystem, as DCP needs)
    mine = {name: file_digest(directory / name) for name in files[rank::world]}
    merged: dict[str, dict] = {}
    for part in _gather(mine):
        merged.update(part)
    if rank == 0:
        path = directory / CHECKSUMS_NAME
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"version": 1, "files": dict(sorted(merged.items()))}, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())


def has_checksums(directory: Path) -> bool:
    return (directory / CHECKSUMS_NAME).is_file()


def verify_checksums(directory: Path) -> list[str]:
    """Collective: what is wrong with `directory`'s files (empty when intact), on every rank.

    A checkpoint without `checksums.json` (written before checksums existed) cannot be
    verified; callers decide what that means (see `has_checksums`).
    """
    rank, world = _dist()
    problems: list[str] = []
    try:
        recorded = json.loads((directory / CHECKSUMS_NAME).read_text(encoding="utf-8"))["files"]
        assert isinstance(recorded, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        recorded = None
        if rank == 0:
            problems.append(f"{CHECKSUMS_NAME} is unreadable ({exc.__class__.__name__})")
    if recorded is not None:
        for name in sorted(recorded)[rank::world]:
            path = directory / name
            if not path.is_file():
                problems.append(f"{name} is missing")
                continue
            expected = recorded[name]
            size = path.stat().st_size
            if size != expected["size"]:
                problems.append(f"{name} is {size} bytes, {expected['size']} were written (truncated or damaged)")
            elif file_digest(path)["sha256"] != expected["sha256"]:
                problems.append(f"{name} does not match its checksum (modified or damaged)")
    return [p for part in _gather(problems) for p in part]
