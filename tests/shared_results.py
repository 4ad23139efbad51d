"""Work that several tests read, done once per test session (across pytest-xdist workers too).

A result is a directory under the session's base temporary directory, which every xdist
worker of the session shares. The first test that asks for a name builds it while holding a
file lock; a test asking meanwhile waits, then reads the same directory. Readers treat it as
read-only: a test that continues a shared run copies it first.

A build that fails leaves nothing behind: the error fails the test that asked, and the next
test asking for the name builds it again (and fails with its own traceback).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


class SharedResults:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, build: Callable[[Path], None]) -> Path:
        """The directory `name`, made by `build(directory)` unless this session already made it."""
        path = self.root / name
        done = self.root / f"{name}.done"
        with FileLock(self.root / f"{name}.lock"):
            if not done.is_file():
                shutil.rmtree(path, ignore_errors=True)  # a build that failed part-way
                path.mkdir()
                try:
                    build(path)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
                done.touch()
        return path
