"""Hash a directory tree before and after a command: what did it change?

The hostile-input tests assert two things of every refused or failed command: the
one-line message, and that nothing outside the command's own files changed.
`snapshot(root)` maps every file (and directory) under `root` to its mode and
content hash; `changes(before, after)` lists what was added, removed or modified.
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path


def snapshot(root: str | Path, ignore: tuple[str, ...] = ()) -> dict[str, tuple[int, str]]:
    """{relative path: (mode, sha256 of the content or '<dir>')} for everything under `root`.

    Args:
        ignore: relative paths (files or directories) left out, e.g. a cache the command may fill.
    """
    root = Path(root)
    found: dict[str, tuple[int, str]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if any(rel == skip or rel.startswith(skip + "/") for skip in ignore):
            continue
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            found[rel] = (stat.S_IMODE(info.st_mode), "<dir>")
        elif stat.S_ISLNK(info.st_mode):
            found[rel] = (0, "-> " + str(path.readlink()))
        else:
            found[rel] = (stat.S_IMODE(info.st_mode), hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def changes(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> list[str]:
    """Sorted `+ path` (added), `- path` (removed), `~ path` (content or mode changed)."""
    out = [f"+ {p}" for p in after.keys() - before.keys()]
    out += [f"- {p}" for p in before.keys() - after.keys()]
    out += [f"~ {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(out)
