"""One run per run directory: a lock for the run's life, the run's identity, no mixed runs.

`glmtune train` claims `logging.run_dir` before it writes anything:
  * a lock (`.glmtune.lock`, flock) held until the process exits; a second run into the
    same directory is refused with the holder's pid, host and start time;
  * the run's identity in `run.json` (a run id that every checkpoint records, so
    resuming and retention only ever touch this run's checkpoints);
  * a fresh start (`checkpoint.resume none`) into a directory that holds an earlier run's
    checkpoints, or a different resolved config, is refused unless the user resumes it
    or passes `--overwrite`, which removes that run's checkpoints and outputs (the files
    `glmtune train` writes, nothing else) and says so;
  * the run and checkpoint directories must be writable, checked with a probe file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from glmtune.checkpoint.manager import CheckpointManager

RUN_FILE = "run.json"
LOCK_FILE = ".glmtune.lock"
# What `glmtune train` writes into a run directory besides checkpoints; `--overwrite`
# removes these and nothing else (data/ is content-addressed and safe to reuse).
# Its appearance asks a running training to save a checkpoint and stop (the Slurm batch script's
# trap and `glmtune train --nproc-per-node`'s SIGUSR1 create it; rank 0 removes it once saved).
STOP_FILE = "STOP_REQUESTED"
RUN_OUTPUTS = ("config.yaml", RUN_FILE, "metrics.jsonl", "tensorboard", "trainable.json", "data_manifest.json",
               "pii_report.json", "samples.json", "hf", "base", "adapter", "adapter_per_expert", STOP_FILE)


def read_run_record(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable run record ({exc}); move it away or pass --overwrite") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ValueError(f"{path}: not a glmtune run record (no run_id); move it away or pass --overwrite")
    return record


def write_run_record(run_dir: Path, record: dict[str, Any]) -> None:
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


# Where a run writes and whether it resumes are not what it trains: a run directory that
# was moved, or a run resumed, is the same run.
_NOT_THE_RUN = ("logging.run_dir", "checkpoint.dir", "checkpoint.resume", "data.cache_dir")


def config_changes(saved_yaml: str, new_yaml: str) -> list[str]:
    """`key: old -> new` for every resolved setting that differs (locations and resume aside)."""
    old, new = _flatten(yaml.safe_load(saved_yaml) or {}), _flatten(yaml.safe_load(new_yaml) or {})
    return [f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key) and key not in _NOT_THE_RUN]


def check_writable(directory: Path, key: str, create: bool = False) -> None:
    """Prove that `directory` takes a file, or say which setting to change.

    Without `create`, a directory that does not exist yet is not made: its nearest
    existing ancestor is probed instead (the run creates it when it first saves).
    """
    probe_dir = Path(directory)
    try:
        if create:
            probe_dir.mkdir(parents=True, exist_ok=True)
        while not probe_dir.exists():
            probe_dir = probe_dir.parent
        if not probe_dir.is_dir():
            raise ValueError(f"{key} {directory}: {probe_dir} is a file, not a directory; choose another with "
                             f"--{key}")
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".glmtune-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"{key} {directory} is not writable ({exc.strerror or exc}); fix its permissions or "
                         f"choose another with --{key}") from None


class RunDirectory:
    """The claim of one `glmtune train` process on its run directory (rank 0 only).

    Args:
        run_dir: `logging.run_dir`.
        checkpoint_dir: `checkpoint.dir` (often inside run_dir, but need not be).
        say: where user-facing lines go.
    """

    def __init__(self, run_dir: str | Path, checkpoint_dir: str | Path, say: Callable[[str], None]) -> None:
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.say = say
        self._lock_fh = None

    def lock(self) -> None:
        """Take the run directory's lock (kept until the process exits) or name its holder."""
        check_writable(self.run_dir, "logging.run_dir", create=True)
        path = self.run_dir / LOCK_FILE
        fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise ValueError(f"logging.run_dir {self.run_dir} is in use by {holder}; wait for that run to end "
                             "or choose another --logging.run_dir") from None
        self._lock_fh = fh

    def release(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()  # closing the descriptor drops the flock
            self._lock_fh = None

    def _mark_lock(self) -> None:
        fh = self._lock_fh
        assert fh is not None, "lock() first"
        fh.seek(0)
        fh.truncate()
        fh.write(f"glmtune train (pid {os.getpid()} on {socket.gethostname()}, started "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        fh.flush()

    def claim(self, config_yaml: str, resume: str, overwrite: bool) -> str:
        """Decide whose run this directory holds; returns the run id this process trains as.

        Raises ValueError (before anything is written) when a fresh start would mix with
        an earlier run and `overwrite` is not set.
        """
        assert self._lock_fh is not None, "lock() first"
        record = read_run_record(self.run_dir) if not overwrite else None
        saved_config = self.run_dir / "config.yaml"
        previous_id = record["run_id"] if record else None
        manager = CheckpointManager(self.checkpoint_dir, run_id=previous_id)
        earlier = manager.owned()
        fresh = resume in ("none", "", None)
        if overwrite:
            self._remove_previous_run()
        elif fresh:
            reasons = []
            if earlier:
                reasons.append(f"checkpoints up to step {earlier[-1].step} in {self.checkpoint_dir}")
            if saved_config.is_file() and config_changes(saved_config.read_text(encoding="utf-8"), config_yaml):
                changed = config_changes(saved_config.read_text(encoding="utf-8"), config_yaml)
                reasons.append(f"a different config ({changed[0]}" + (f", and {len(changed) - 1} more)"
                                                                      if len(changed) > 1 else ")"))
            if reasons:
                raise ValueError(f"logging.run_dir {self.run_dir} already holds another run ({'; '.join(reasons)}); "
                                 "continue it with --checkpoint.resume auto, start over with --overwrite (removes "
                                 "that run's checkpoints and outputs), or choose another --logging.run_dir")
        elif saved_config.is_file():
            changed = config_changes(saved_config.read_text(encoding="utf-8"), config_yaml)
            if changed:
                self.say("resuming with changed settings: " + "; ".join(changed))
        run_id = previous_id if (record and not fresh) else uuid.uuid4().hex[:16]
        self._mark_lock()
        write_run_record(self.run_dir, {
            "run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "created": record.get("created", time.strftime("%Y-%m-%dT%H:%M:%S%z")) if record and not fresh
            else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        return run_id

    def _remove_previous_run(self) -> None:
        """--overwrite: the earlier run's checkpoints and outputs go; unknown files stay."""
        try:
            record = read_run_record(self.run_dir)
        except ValueError:
            record = None
        manager = CheckpointManager(self.checkpoint_dir, run_id=record["run_id"] if record else None)
        removed = [c.path.name for c in manager.owned()]
        for checkpoint in manager.owned():
            shutil.rmtree(checkpoint.path)
        if self.checkpoint_dir.is_dir():
            for leftover in [*self.checkpoint_dir.glob(".step-*.partial"), *self.checkpoint_dir.glob("abandoned-step-*")]:
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover.name)
        for name in RUN_OUTPUTS:
            path = self.run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
                removed.append(name)
            elif path.exists() or path.is_symlink():
                path.unlink()
                removed.append(name)
        if removed:
            self.say(f"--overwrite: removed the previous run's files from {self.run_dir}: {', '.join(removed)}")
