"""The files a safetensors index names: inside the checkpoint directory, or refused in one sentence.

`model.safetensors.index.json` maps every tensor to a file name, which the readers (loading for
train, eval and merge, `inspect`'s verifier, the base fingerprint, the release) join to the
checkpoint directory. The index is text anyone may have written: `../../x` or `/etc/passwd`
would have them open a file outside the checkpoint. So a name must be a relative path inside
the directory (a plain file name, or one in a subdirectory; no `..`, not absolute, no NUL or
backslash), and the file it names, links resolved, must lie inside the directory too, and be
a regular file (not a device or a pipe, which would never end).

Two kinds of link out are allowed, because glmtune and the Hugging Face cache make them: in a
cache snapshot (`<repo>/snapshots/<revision>/`) every file is a link into `<repo>/blobs/`, so
there a file may resolve into that repository's `blobs/` directory; in a truncated view
(truncated_view.py: the first K layers of a checkpoint, written for preflight) every shard is a
link to the same-named shard of the checkpoint its index records (`metadata.truncated_from`),
so there a file may be that file and no other.
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


VIEW_SOURCE_KEY = "truncated_from"  # in a truncated view's index metadata: the checkpoint it links to


def view_source(index: object) -> Path | None:
    """The checkpoint a truncated view's parsed index says its shards link to (None: not a view)."""
    metadata = index.get("metadata") if isinstance(index, dict) else None
    source = metadata.get(VIEW_SOURCE_KEY) if isinstance(metadata, dict) else None
    return Path(source) if isinstance(source, str) and os.path.isabs(source) else None


def _a_views_link(real: str, name: str, source: Path | None) -> bool:
    """`real` is the same-named shard of the checkpoint a truncated view was cut from."""
    return (source is not None and (source / "config.json").is_file()
            and real == os.path.realpath(source / PurePosixPath(name).name))


def outside_reason(directory: Path, name: object, source: Path | None = None) -> str | None:
    """Why `name` (from an index) does not name a file inside `directory` (None when it does,
    or when that file does not exist: the callers name a missing file themselves). `source`:
    the checkpoint the index says it is a truncated view of (`view_source`)."""
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
    inside = any(real == root or real.startswith(root + os.sep) for root in _allowed_roots(directory))
    if not inside and not _a_views_link(real, name, source):
        return f"is a link that leads out of {directory} (to {printable(real)})"
    try:
        regular = stat.S_ISREG(os.stat(real).st_mode)
    except OSError:
        return None  # a dangling link: reported as a missing file
    return None if regular else "is not a regular file (a directory, a device or a pipe)"


def shard_file(directory: Path, name: object, listed_in: Path, key: str, source: Path | None = None) -> Path:
    """`directory / name` when `name` (the file the index `listed_in` gives tensor `key`) stays
    inside the checkpoint (module docstring); else a ValueError naming the index and the entry."""
    reason = outside_reason(directory, name, source)
    if reason:
        raise ValueError(f"{listed_in}: the entry for {_shown(key)} names {_shown(name)}, which {reason}")
    return directory / str(name)
