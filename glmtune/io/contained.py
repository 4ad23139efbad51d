"""A file name read from a file, kept inside the directory that file describes.

A manifest names its own files: a prepared dataset's `manifest.json` its split files, a run's
`data_manifest.json` its validation split. The manifest is text anyone may have edited, and
`directory / "../../x"` or `directory / "/etc/passwd"` would have the reader open a file outside
the directory it was given. So a name read from a file must be a relative path inside the
directory: not absolute, no `..`, no NUL or backslash, and, with `plain` (what glmtune writes
there), one file name without a subdirectory; the file it names, links resolved, lies inside the
directory too and is a regular file (not a device or a pipe, which would never end).

The same rule for the files of a checkpoint index, with the links out that a Hugging Face cache
and a truncated view make, is `glmtune.checkpoint.shard_paths` (a floor above this one).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from glmtune.io.text_limits import clipped


def outside_reason(directory: Path, name: object, plain: bool = True, want_dir: bool = False) -> str | None:
    """Why `name` does not name a file (with `want_dir`, a subdirectory) inside `directory` (None
    when it does, or when nothing is there: the callers say a file is missing in their own words)."""
    if not isinstance(name, str) or name in ("", ".") or "\0" in name or "\\" in name:
        return "is not a file name"
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute():
        return f"is an absolute path, not a file of {directory}"
    if ".." in parts:
        return f"leaves {directory} through '..'"
    if plain and len(parts) != 1:
        return "is not a plain file name (glmtune writes its files there without a subdirectory)"
    path = Path(directory) / name
    if not os.path.lexists(path):
        return None
    root, real = os.path.realpath(directory), os.path.realpath(path)
    if not real.startswith(root + os.sep):
        return f"is a link that leads out of {directory} (to {clipped(real)})"
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return None  # a dangling link: reported as a missing file
    if want_dir:
        return None if stat.S_ISDIR(mode) else "is not a directory"
    return None if stat.S_ISREG(mode) else "is not a regular file (a directory, a device or a pipe)"


def inside(directory: str | Path, name: object, where: str, plain: bool = True, want_dir: bool = False) -> Path:
    """`directory / name` when `name` (read from the file `where` says) stays inside `directory`
    (module docstring); else a ValueError naming `where` and the name."""
    reason = outside_reason(Path(directory), name, plain, want_dir)
    if reason:
        raise ValueError(f"{where} names {clipped(repr(name), 120)}, which {reason}")
    return Path(directory) / str(name)
