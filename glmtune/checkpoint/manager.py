"""Training checkpoints with torch.distributed.checkpoint (DCP): save, find, resume, retain.

A checkpoint is a directory `RUN_DIR/checkpoints/step-00000123/` holding
  * the DCP shards of {"model": ..., "optim": ...} (sharded tensors stay sharded),
  * `trainer_state.pt`: step, scheduler, data-loader position, counters (rank 0),
  * `rng-rank{R}.pt`: every RNG state of rank R (python, torch CPU, CUDA).
Router correction biases are persistent model buffers and travel with the model.

Atomicity: everything is written under `.step-00000123.partial/`, which is renamed
to its final name only after every file is on disk; a run killed mid-save leaves
a `.partial` directory that is never picked up and is cleaned by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

_STEP_RE = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Checkpoint:
    path: Path
    step: int


class CheckpointManager:
    """Saves and restores model + optimizer + trainer state under `root`.

    Args:
        root: directory holding `step-*` checkpoints.
        keep_last: how many complete checkpoints to keep (0 keeps all).
        trainable_only: save only trainable parameters and buffers (adapter runs);
            the frozen base is reloaded from its own checkpoint on resume.
    """

    def __init__(self, root: str | Path, keep_last: int = 2, trainable_only: bool = False) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.trainable_only = trainable_only
        self._pending: tuple | None = None  # an asynchronous save not yet made visible

    # -- discovery --------------------------------------------------------------------
    def complete(self) -> list[Checkpoint]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_RE.match(child.name)
            if match and child.is_dir() and (child / "trainer_state.pt").is_file():
                found.append(Checkpoint(child, int(match.group(1))))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def resolve(self, resume: str) -> Checkpoint | None:
        """`none` -> None, `auto` -> newest complete checkpoint (or None), else a path."""
        if resume in ("none", "", None):
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        match = _STEP_RE.match(path.name)
        if not (path / "trainer_state.pt").is_file() or not match:
            raise ValueError(f"checkpoint.resume: {path} is not a complete glmtune checkpoint (step-N directory)")
        return Checkpoint(path, int(match.group(1)))

    # -- state ------------------------------------------------------------------------
    def _options(self) -> StateDictOptions:
        # Adapter runs save no frozen base weights, so loading them back cannot be strict.
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], async_save: bool = False) -> Path:
        """Write checkpoint `step`. With `async_save`, tensors are staged to host memory and
        written in the background; the checkpoint becomes visible (renamed) in `wait()`,
        which the next save and the end of training call."""
        self.wait()
        final = self.root / f"step-{step:08d}"
        partial = self.root / f".step-{step:08d}.partial"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".step-*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        state = {"model": model_sd, "optim": optim_sd}
        rng = capture_rng()
        trainer_state = dict(trainer_state, step=step)
        if async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial))
            self._pending = (future, partial, final, rng, trainer_state)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._finalize(partial, final, rng, trainer_state)
        return final

    def wait(self) -> None:
        """Finish a pending asynchronous save (no-op when none)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        future, partial, final, rng, trainer_state = pending
        future.result()
        self._finalize(partial, final, rng, trainer_state)

    def _finalize(self, partial: Path, final: Path, rng: dict[str, Any], trainer_state: dict[str, Any]) -> None:
        torch.save(rng, partial / f"rng-rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            torch.save(trainer_state, partial / "trainer_state.pt")
            _fsync_dir(partial)
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            self._retain()
        _barrier()

    def load(self, checkpoint: Checkpoint, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG; returns the trainer state."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(checkpoint.path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._options())
        rng_file = checkpoint.path / f"rng-rank{_rank()}.pt"
        if rng_file.is_file():
            restore_rng(torch.load(rng_file, weights_only=False))
        return torch.load(checkpoint.path / "trainer_state.pt", weights_only=False)

    def set_aside_after(self, step: int) -> list[Path]:
        """Resuming from `step` abandons any newer checkpoint: rename those (never delete) so
        that neither `resume auto` nor retention mistakes them for this run's latest."""
        moved = []
        if _rank() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for checkpoint in self.complete():
                if checkpoint.step > step:
                    target = checkpoint.path.with_name(f"abandoned-{checkpoint.path.name}-{stamp}")
                    checkpoint.path.rename(target)
                    moved.append(target)
        _barrier()
        return moved

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
