"""The files a safetensors index names: inside the checkpoint directory, or refused in one sentence.

`model.safetensors.index.json` maps every tensor to a file name, which the readers (loading for
train, eval and merge, `inspect`'s verifier, the base fingerprint, the release) join to the
checkpoint directory. The index is text anyone may have written: `../../x` or `/etc/passwd`
would have them open a file outside the checkpoint. So a name must be a relative path inside
the directory (a plain file name, or one in a subdirectory; no `..`, not absolute, no NUL or
backslash), and the file it names, links resolved, must lie inside the directory too, and be
a regular file (not a device or a pipe, which would never end).

One link out is allowed, because the Hugging Face cache is made of them: in a cache snapshot
(`<repo>/snapshots/<revision>/`) every file is a link into `<repo>/blobs/`, so there the file
may resolve into that repository's `blobs/` directory as well.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from glmtune.io.text_limits import printable


def _shown(value: object) -> str:
    text = printable(repr(value))
    return text if len(text) <= 120 else text[:117] + "..."


def _allowed_roots(directory: Path) -> list[str]:
    """The real directories a checkpoint's files may resolve into."""
    real = Path(os.path.realpath(directory))
    roots = [str(real)]
    if real.parent.name == "snapshots":  # a Hugging Face cache snapshot: links into <repo>/blobs
        roots.append(str(real.parent.parent / "blobs"))
    return roots


def outside_reason(directory: Path, name: object) -> str | None:
    """Why `name` (from an index) does not name a file inside `directory` (None when it does,
    or when that file does not exist: the callers name a missing file themselves)."""
    if not isinstance(name, str) or name in ("", ".") or "\0" in name or "\\" in name:
        return "is not a file name"
    if PurePosixPath(name).is_absolute():
        return "is an absolute path, not a file of the checkpoint"
    if ".." in PurePosixPath(name).parts:
        return "leaves the checkpoint directory through '..'"
    path = directory / name
    if not os.path.lexists(path):
        return None
    real = os.path.realpath(path)
    if not any(real == root or real.startswith(root + os.sep) for root in _allowed_roots(directory)):
        return f"is a link that leads out of {directory} (to {printable(real)})"
    try:
        regular = stat.S_ISREG(os.stat(real).st_mode)
    except OSError:
        return None  # a dangling link: reported as a missing file
    return None if regular else "is not a regular file (a directory, a device or a pipe)"


def shard_file(directory: Path, name: object, listed_in: Path, key: str) -> Path:
    """`directory / name` when `name` (the file the index `listed_in` gives tensor `key`) stays
    inside the checkpoint (module docstring); else a ValueError naming the index and the entry."""
    reason = outside_reason(directory, name)
    if reason:
        raise ValueError(f"{listed_in}: the entry for {_shown(key)} names {_shown(name)}, which {reason}")
    return directory / str(name)
