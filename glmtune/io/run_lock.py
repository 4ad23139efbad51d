"""A run directory's lock, record and stop file: what tells any command whose run a directory holds.

  * `LOCK_FILE` (`.glmtune.lock`): flocked exclusively by `glmtune train` for the run's life
    (`RunLock`). Its one line names the holder (pid, host, start time); a run that ends
    (finished or failed) rewrites it as `released: ...`. A run that was killed leaves its
    line there with the flock gone: a stale lock, which the next run takes over. Other
    commands ask `lock_holder` whether a run is training there now (`glmtune release` refuses
    one that is);
  * `RUN_FILE` (`run.json`): the run's identity, a `run_id` that every checkpoint records
    (plus its start and creation times and the base it trained from), read with its size and
    nesting bounded (`read_run_record`) and written atomically (`write_run_record`);
  * `STOP_FILE` (`STOP_REQUESTED`): its appearance asks a running training to save a
    checkpoint and stop (the Slurm batch script's trap and `glmtune train --nproc-per-node`'s
    SIGUSR1 create it; rank 0 removes it once saved).

Which of them a run directory must have, and what `--overwrite` removes, is
glmtune/train/run_dir.py's business.
"""

from __future__ import annotations

import fcntl
import json
import re
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from glmtune.io.text_limits import parse_json

RUN_FILE = "run.json"
LOCK_FILE = ".glmtune.lock"
STOP_FILE = "STOP_REQUESTED"
RELEASED = "released:"  # how the lock file's line starts once its run has ended
RUN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")  # glmtune writes 16 hex digits; a run id is never a path


def read_run_record(run_dir: Path) -> dict[str, Any] | None:
    """`run_dir`'s run record, None when it has none; ValueError when it is not a glmtune run record."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = parse_json(path.read_bytes(), str(path), max_bytes=1 << 20)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable run record ({exc}); not a glmtune run directory") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ValueError(f"{path}: not a glmtune run record (no run_id); not a glmtune run directory")
    if not RUN_ID.fullmatch(record["run_id"]):  # it names files and directories (checkpoint tags, set-asides)
        raise ValueError(f"{path}: its run_id is not one glmtune writes (letters, digits, '-' and '_'); not a "
                         "glmtune run directory")
    return record


def write_run_record(run_dir: Path, record: dict[str, Any]) -> None:
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def lock_holder(run_dir: Path) -> str | None:
    """The line of the process that holds `run_dir`'s lock now (a training run), else None."""
    lock = Path(run_dir) / LOCK_FILE
    if not lock.is_file():
        return None
    with open(lock, encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return fh.read().strip() or "another process"
    return None


def _open_locked(path: Path) -> IO[str]:
    """`path` opened and flocked (exclusively, without waiting), or the holder's line as a ValueError."""
    for _ in range(5):
        fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run's life
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise ValueError(holder) from None
        # A refused run removes the lock file it created: a lock taken on the removed file
        # would be nobody's, so take the one now at `path` instead.
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()
    raise ValueError("another process (its lock file keeps being replaced)")


class RunLock:
    """The exclusive flock on a run directory's `LOCK_FILE`, held by one process for a run's life.

    `acquire` takes it, `mark` writes this process's line into it (the directory is claimed),
    `release` ends it: a marked lock is rewritten as released; an unmarked one that this
    process created is removed, one that was there is left as it was.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.existed = False  # the lock file was there before this process: a run has used the directory
        self._fh: IO[str] | None = None
        self._marked = False  # this process wrote its line into the lock file

    @property
    def held(self) -> bool:
        return self._fh is not None

    def acquire(self) -> str | None:
        """Take the flock without waiting; returns the line of a stale lock this process takes
        over (its holder ended without releasing it), else None.

        Raises:
            ValueError: another process holds it; the message is that process's line.
        """
        self.existed = os.path.lexists(self.path)
        fh = _open_locked(self.path)
        fh.seek(0)
        previous = fh.read().strip()
        self._fh = fh
        return previous if previous and not previous.startswith(RELEASED) else None

    def mark(self) -> None:
        """Write this process's line (pid, host, start time) into the held lock file."""
        fh = self._fh
        assert fh is not None, "acquire() first"
        fh.seek(0)
        fh.truncate()
        fh.write(f"glmtune train (pid {os.getpid()} on {socket.gethostname()}, started "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        fh.flush()
        self._marked = True

    def release(self) -> None:
        """Mark a claimed lock released, or remove the lock file this process created; drop the flock."""
        fh = self._fh
        if fh is None:
            return
        self._fh = None
        if self._marked:
            fh.seek(0)
            line = fh.read().strip()
            fh.seek(0)
            fh.truncate()
            fh.write(f"{RELEASED} {line}, ended {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            fh.flush()
        elif not self.existed:
            self.path.unlink(missing_ok=True)  # still ours: the flock is held
        fh.close()  # closing the descriptor drops the flock
