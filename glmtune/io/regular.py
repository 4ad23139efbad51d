"""Input files that are files: a FIFO, a socket, a device or a directory is refused before it is read.

`open()` of a FIFO (named pipe) waits for a writer that may never come, so `glmtune data
validate pipe.jsonl` would hang with no message; a character device can stream forever
(`/dev/zero`), a socket cannot be opened at all. Every data, schema, template and tokenizer
file glmtune reads is checked here first, by `os.stat` (which follows a symlink to its
target and opens nothing): anything but a regular file is one ValueError naming the path and
what it is.

  * `check_regular_file(path, what)`: the check, for a path handed to a library that opens it
    itself (pyarrow, transformers).
  * `open_regular(path, what)`: the check, then an open that cannot block (O_NONBLOCK) and a
    second check of what was opened (a FIFO swapped in between the two is refused too).
  * `check_entries(directory, what, recursive)`: the same for every entry of a directory that a
    library reads as a whole (a tokenizer directory, a `datasets` directory); subdirectories
    are allowed there.
  * `kind_of(path)`: what a path is when it is not a regular file, for a caller that lists or
    reports such entries itself (`glmtune release` and `release verify`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refusal(path: Path, what: str, mode: int) -> ValueError:
    label = f"{what} {path}" if what else str(path)
    return ValueError(f"{label} is {_kind(mode)}, not a regular file: glmtune reads only regular files "
                      "(a pipe or a device could block or never end); give the file itself")


def kind_of(path: str | Path) -> str | None:
    """None when `path` is (or links to) a regular file, else what it is: "a FIFO (named pipe)",
    "a socket", "a character device", "a block device", "a directory", "a link to nothing", "missing", or
    "unreadable (REASON)" (a link loop, no permission)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else _kind(mode)


def check_regular_file(path: str | Path, what: str = "") -> Path:
    """`path` when it is (or links to) a regular file; ValueError naming it otherwise
    (FileNotFoundError when there is nothing there)."""
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _refusal(path, what, mode)
    return path


def open_regular(path: str | Path, what: str = "") -> BinaryIO:
    """`path` opened for binary reading, after `check_regular_file`; the open itself cannot block."""
    path = check_regular_file(path, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refusal(path, what, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_entries(directory: str | Path, what: str = "", recursive: bool = False) -> None:
    """ValueError naming the first entry of `directory` (with `recursive`, of its tree) that is
    neither a regular file nor a directory (a dangling symlink is left to the reader)."""
    walk = os.walk(directory)
    tree = walk if recursive else [next(walk, (str(directory), [], []))]
    for root, _, files in tree:
        for name in files:  # os.walk lists FIFOs, sockets and devices among the files
            path = Path(root) / name
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                raise _refusal(path, what, mode)
