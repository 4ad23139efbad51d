"""Training checkpoints with torch.distributed.checkpoint (DCP): save, verify, resume, retain.

A checkpoint is a directory `RUN_DIR/checkpoints/step-00000123/` holding
  * the DCP shards of {"model": ..., "optim": ...} (sharded tensors stay sharded) and
    their layout, `dcp_metadata.json` (dcp_storage.py: JSON, not DCP's pickled `.metadata`),
  * `trainer_state.json`: step, run id, scheduler, data-loader position, counters (rank 0),
  * `rng-rank{R}.pt`: every RNG state of rank R (python, torch CPU, CUDA): tensors, ints
    and tuples only, read back with `weights_only=True`,
  * `checksums.json`: size and sha256 of every other file (integrity.py), written last; it
    lists the directory exactly (a file not listed, or listed and missing, is damage).
Nothing is unpickled as code: the layout and the trainer state are JSON, tensors and the
optimizer's non-tensor values (lr, betas, parameter names) and the RNG files are torch.save
archives whose pickles are checked before loading (pickle_scan.py: tensors and plain values
only) and then read by torch's weights-only unpickler. A file planted in a checkpoint (with
its checksums rewritten to match) therefore fails to load as a damaged checkpoint and never
runs. What is read is checked against what the writer writes before it is applied
(state_schema.py): the trainer state against the trainer's own (`expected_state`), the
optimizer's param_groups against the optimizer's, the RNG states against their types; a
hostile value is a damaged checkpoint named in one line, never an attribute set on the
scheduler. The checksums detect damage, not tampering: whoever can write the checkpoint can
rewrite them too. A checkpoint without `checksums.json` is damaged (every checkpoint glmtune
writes has one). Router correction biases are persistent model buffers and travel with the model.

Atomicity: everything is written under `.step-00000123.RUNID.partial/`, renamed to its
final name only after every file is on disk and checksummed; a run killed mid-save
leaves a `.partial` directory that is never picked up and is cleaned by that run's next
save. A save that fails (disk full, permissions) removes its partial directory and says
why in one line (`CheckpointWriteError`).

Ownership: each checkpoint records the id of the run that wrote it (run_dir.py), and
its partial directory carries it in its name. Resuming, retention, the clean-up of
partial saves and `train --overwrite` consider only the manager's own run's
checkpoints, so a checkpoint directory shared with another run is never pruned, resumed
or cleaned by mistake; when another run already holds `step-N`, this run's step N is
saved as `step-N-RUNID`.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from glmtune.checkpoint.dcp_storage import JsonMetadataReader, JsonMetadataWriter, WeightsOnlyLoadPlanner, failure_of
from glmtune.checkpoint.integrity import CHECKSUMS_NAME, has_checksums, verify_checksums, write_checksums
from glmtune.checkpoint.state_schema import check_param_groups, check_trainer_state, read_rng
from glmtune.io.sizes import human_bytes
from glmtune.io.text_limits import parse_json

# `step-N`, or `step-N-RUNID` when another run sharing the directory already holds step N.
_STEP_RE = re.compile(r"^step-(\d+)(?:-([\w-]{1,64}))?$")
STATE_NAME = "trainer_state.json"
# Checkpoints written before the trainer state was JSON: recognized (so `resume auto` does
# not silently start over beside them) and refused when loaded.
_LEGACY_STATE_NAME = "trainer_state.pt"
_MAX_STATE_BYTES = 64 << 20
_NO_RUN = "norun"  # the partial-save tag of a manager without a run id (tools, tests)


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files do not match their checksums or cannot be read."""


class CheckpointWriteError(OSError):
    """A save that failed for a reason of the filesystem (no space, no permission)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns on every save and load without a process group; one process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _gathered(value: Any) -> list[Any]:
    """Every rank's `value` on every rank (a list of one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _all_ok(ok: bool) -> bool:
    """Whether every rank's `ok` is true (each rank learns the same answer)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


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


def _drop_unsaved_optimizer_state(optim_state: dict[str, Any], reader: JsonMetadataReader) -> set[str]:
    """Remove from the optimizer's state template (DCP's `get_state_dict` fills in a state for every
    parameter of a fresh optimizer) the parameters the checkpoint saved no state of: those its
    optimizer held but never stepped, as the main weights during an indexer warm-up, which have no
    gradient. Loaded strictly, they would make the checkpoint unreadable; loaded as the template has
    them (step 1, zero moments), they would change the later updates. Their names."""
    saved = reader.read_metadata().state_dict_metadata.keys()
    absent = {fqn for fqn, entry in optim_state.get("state", {}).items()
              if not any(f"optim.state.{fqn}.{key}" in saved for key in entry)}
    for fqn in absent:
        del optim_state["state"][fqn]
    return absent


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint directory `path` (JSON, its size and depth bounded)."""
    if not (path / STATE_NAME).is_file():
        raise ValueError(f"{path} has no {STATE_NAME}: written by an older glmtune whose trainer state was a "
                         "pickle, which glmtune no longer reads")
    state = parse_json((path / STATE_NAME).read_bytes(), str(path / STATE_NAME), max_bytes=_MAX_STATE_BYTES)
    if not isinstance(state, dict):
        raise ValueError(f"{path / STATE_NAME}: not a trainer state (a JSON object)")
    return state


def _has_state(path: Path) -> bool:
    return (path / STATE_NAME).is_file() or (path / _LEGACY_STATE_NAME).is_file()


def _os_error(exc: BaseException) -> OSError | None:
    """The filesystem error behind a failed save, looking through DCP's per-rank wrapping."""
    stack, seen = [exc], set()
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error
        stack += [error.__cause__, error.__context__]
        if isinstance(error, CheckpointException):
            stack += [failure[0] for failure in error.failures.values()]
        if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
            # torch.save's zip writer reports a short write this way (a full disk)
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not path.is_mount():
        path = path.parent
    return path


@dataclass
class Checkpoint:
    path: Path
    step: int
    run_id: str | None = None  # None: written before checkpoints recorded their run


class CheckpointManager:
    """Saves and restores model + optimizer + trainer state under `root`.

    Args:
        root: directory holding `step-*` checkpoints.
        keep_last: how many complete checkpoints of this run to keep (0 keeps all).
        trainable_only: save only trainable parameters and buffers (adapter runs);
            the frozen base is reloaded from its own checkpoint on resume.
        run_id: the run this manager saves for (recorded in each checkpoint); None
            accepts every checkpoint (tools that read a checkpoint they were pointed at).
        async_group: a gloo process group for `async_save` under NCCL (ParallelMesh.cpu_group()).
    """

    def __init__(self, root: str | Path, keep_last: int = 2, trainable_only: bool = False,
                 run_id: str | None = None, async_group=None) -> None:
        self.root = Path(root)
        self.async_group = async_group
        self.keep_last = keep_last
        self.trainable_only = trainable_only
        self.run_id = run_id
        self._pending: tuple | None = None  # an asynchronous save not yet made visible

    # -- discovery --------------------------------------------------------------------
    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint under `root`, of any run, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_RE.match(child.name)
            if match and child.is_dir() and not child.is_symlink() and _has_state(child):
                found.append(Checkpoint(child, int(match.group(1)), _recorded_run_id(child)))
        return sorted(found, key=lambda c: (c.step, c.path.name))

    def owned(self) -> list[Checkpoint]:
        """This run's complete checkpoints, oldest first (every checkpoint for a manager without a run id).

        A checkpoint that records no run (or an unreadable trainer state) belongs to no run:
        never resumed, pruned or removed by one.
        """
        return [c for c in self.complete() if self.run_id is None or c.run_id == self.run_id]

    def owned_leftovers(self) -> list[Path]:
        """This run's interrupted saves (`.partial`) and set-aside checkpoints (`abandoned-*`).

        A partial save belongs to the run its name carries; an abandoned checkpoint to the
        run its trainer state records. Nothing of another run, or of unknown origin, is listed.
        """
        if not self.root.is_dir():
            return []
        mine = [p for p in self.root.glob(f".step-*.{self._tag()}.partial") if p.is_dir() and not p.is_symlink()]
        for path in self.root.glob("abandoned-step-*"):
            if path.is_dir() and not path.is_symlink() and _recorded_run_id(path) is not None \
                    and _recorded_run_id(path) == self.run_id:
                mine.append(path)
        return sorted(mine)

    def _tag(self) -> str:
        return self.run_id or _NO_RUN

    def latest(self) -> Checkpoint | None:
        mine = self.owned()
        return mine[-1] if mine else None

    def resolve(self, resume: str) -> Checkpoint | None:
        """`none` -> None, `auto` -> newest complete checkpoint of this run (or None), else a path."""
        if resume in ("none", "", None):
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        match = _STEP_RE.match(path.name)
        if not match or not path.is_dir() or not _has_state(path):
            raise ValueError(f"checkpoint.resume: {path} is not a complete glmtune checkpoint (step-N directory)")
        return Checkpoint(path, int(match.group(1)), _recorded_run_id(path))

    # -- integrity --------------------------------------------------------------------
    def verify(self, checkpoint: Checkpoint) -> list[str]:
        """Collective: what is wrong with `checkpoint` (empty when intact)."""
        if not has_checksums(checkpoint.path):
            return [f"{CHECKSUMS_NAME} is missing (every checkpoint glmtune writes has one: an interrupted copy, or "
                    "not a glmtune checkpoint)"]
        return verify_checksums(checkpoint.path)

    def restore(self, resume: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                say: Callable[[str], None], expected_state: dict[str, Any] | None = None,
                check_state: Callable[[dict[str, Any]], None] | None = None
                ) -> tuple[Checkpoint | None, dict[str, Any] | None]:
        """Load what `checkpoint.resume` names and return it with its trainer state.

        `auto` takes the newest intact checkpoint of this run: a damaged one is named
        and skipped (falling back to the one before it); finding none is said, too. An
        explicitly named checkpoint that is damaged is an error. `expected_state`: the
        trainer state the caller would save now, which the checkpoint's must be like (`load`);
        `check_state`: the caller's own checks of its values (ValueError: the checkpoint is damaged).
        """
        if resume in ("none", "", None):
            return None, None
        if resume != "auto":
            checkpoint = self.resolve(resume)
            problems = self.verify(checkpoint)
            if problems:
                raise DamagedCheckpointError(f"checkpoint.resume: {checkpoint.path} is damaged: {problems[0]}"
                                             + _more(problems) + "; resume from another checkpoint")
            return checkpoint, self.load(checkpoint, model, optimizer, expected_state, check_state)
        candidates = self.owned()
        others = len(self.complete()) - len(candidates)
        if others:
            say(f"checkpoint.resume auto: ignoring {others} checkpoint(s) in {self.root} written by another run")
        if not candidates:
            say(f"checkpoint.resume auto: no checkpoint in {self.root}; starting at step 0")
            return None, None
        for checkpoint in reversed(candidates):
            problems = self.verify(checkpoint)
            if not problems:
                try:
                    return checkpoint, self.load(checkpoint, model, optimizer, expected_state, check_state)
                except DamagedCheckpointError as exc:
                    problems = [str(exc)]
            say(f"checkpoint {checkpoint.path} is damaged ({problems[0]}{_more(problems)}); "
                "falling back to the checkpoint before it")
        raise DamagedCheckpointError(f"checkpoint.resume auto: every checkpoint in {self.root} is damaged; "
                                     "start over with --overwrite or resume from a copy")

    # -- state ------------------------------------------------------------------------
    def _options(self) -> StateDictOptions:
        # Adapter runs save no frozen base weights, so loading them back cannot be strict.
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def _state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a checkpoint holds: DCP's model and optimizer state dicts. An optimizer holding
        fp32 masters of the parameters (`glmtune.train.master_adamw.MasterAdamW.with_masters`)
        puts them in the parameters' place: saved instead of their bf16 copies, loaded into."""
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        with_masters = getattr(optimizer, "with_masters", None)
        return {"model": with_masters(model_sd) if with_masters else model_sd, "optim": optim_sd}

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], async_save: bool = False) -> Path:
        """Write checkpoint `step`. With `async_save`, tensors are staged to host memory and
        written in the background; the checkpoint becomes visible (renamed) in `wait()`,
        which the next save and the end of training call.

        Raises:
            CheckpointWriteError: the filesystem refused (no space, no permission); the
                partial checkpoint is removed first.
        """
        self.wait()
        final = self._final_path(step)
        partial = self.root / f".step-{step:08d}.{self._tag()}.partial"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f".step-*.{self._tag()}.partial"):  # this run's interrupted saves only
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        state = self._state(model, optimizer)
        rng = capture_rng()
        trainer_state = dict(trainer_state, step=step, run_id=self.run_id)
        try:
            with _quiet_single_process():
                if async_save:
                    future = dcp.async_save(state, storage_writer=JsonMetadataWriter(partial),
                                            process_group=self.async_group)
                    self._pending = (future, partial, final, rng, trainer_state)
                else:
                    dcp.save(state, storage_writer=JsonMetadataWriter(partial))
                    self._finalize(partial, final, rng, trainer_state)
        except (Exception, CheckpointException) as exc:
            raise self._failed(exc, partial, final) from None
        return final

    def wait(self) -> None:
        """Finish a pending asynchronous save (no-op when none)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        future, partial, final, rng, trainer_state = pending
        try:
            future.result()
            self._finalize(partial, final, rng, trainer_state)
        except (Exception, CheckpointException) as exc:
            raise self._failed(exc, partial, final) from None

    def _finalize(self, partial: Path, final: Path, rng: dict[str, Any], trainer_state: dict[str, Any]) -> None:
        error: BaseException | None = None
        try:  # each rank's own small files; every rank must learn whether all of them succeeded
            torch.save(rng, partial / f"rng-rank{_rank()}.pt")
            if _rank() == 0:
                _write_json(partial / STATE_NAME, trainer_state)
        except (OSError, RuntimeError) as exc:
            error = exc
        if not _all_ok(error is None):
            raise error or RuntimeError("another rank failed to write its checkpoint files")
        write_checksums(partial)
        if _rank() == 0:
            _fsync_dir(partial)
            if final.exists():  # this run re-saving its own step (_final_path never names another run's)
                shutil.rmtree(final)
            partial.rename(final)
            self._retain(trainer_state["step"])
        _barrier()

    def _final_path(self, step: int) -> Path:
        """`step-N`, unless another run sharing the directory holds it: then `step-N-RUNID`."""
        plain = self.root / f"step-{step:08d}"
        if not plain.exists() or self.run_id is None or _recorded_run_id(plain) in (None, self.run_id):
            return plain
        return self.root / f"step-{step:08d}-{self.run_id}"

    def _failed(self, exc: BaseException, partial: Path, final: Path) -> BaseException:
        """Remove the partial checkpoint; a filesystem refusal becomes one sentence."""
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        cause = _os_error(exc)
        if cause is None:
            return exc  # not the filesystem: a bug, shown with its traceback
        latest = self.latest()
        kept = f"the last complete checkpoint is {latest.path}" if latest else "no checkpoint of this run exists yet"
        if cause.errno == errno.ENOSPC:
            where = _mount_point(self.root)
            free = shutil.disk_usage(where).free
            reason = f"no space left on {where} ({human_bytes(free)} free)"
        else:
            reason = cause.strerror or str(cause)
        return CheckpointWriteError(cause.errno, f"cannot write checkpoint {final}: {reason}; removed the "
                                                 f"partial checkpoint; {kept}")

    def load(self, checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             expected_state: dict[str, Any] | None = None,
             check_state: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG; returns the trainer state.

        Args:
            expected_state: the trainer state the caller would save now; the checkpoint's must
                have exactly its fields, each of the same kind (`check_trainer_state`).
            check_state: checks of the trainer state's values, run before anything is loaded.

        Raises:
            DamagedCheckpointError: a file of the checkpoint cannot be read, or holds a value
                the writer never writes.
        """
        state = self._state(model, optimizer)
        read, problem, cause = None, None, None
        try:
            read = self._read(checkpoint, state, expected_state, check_state)
        except (Exception, CheckpointException) as exc:
            problem, cause = failure_of(exc)[:400], exc
        problems = [p for p in _gathered(problem) if p]  # a rank's own RNG file fails every rank alike
        if problems:
            raise DamagedCheckpointError(f"{checkpoint.path} cannot be read: {problems[0]}") from cause
        trainer_state, rng = read
        try:
            # Not strict for the optimizer: the parameters it never stepped stay without state, as they were.
            set_optimizer_state_dict(model, optimizer, state["optim"], options=replace(self._options(), strict=False))
            set_model_state_dict(model, state["model"], options=self._options())
        except (Exception, CheckpointException) as exc:
            raise DamagedCheckpointError(f"{checkpoint.path} cannot be read: {failure_of(exc)[:400]}") from exc
        if rng is not None:
            restore_rng(rng)
        return trainer_state

    def _read(self, checkpoint: Checkpoint, state: dict[str, Any], expected_state: dict[str, Any] | None,
              check_state: Callable[[dict[str, Any]], None] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Fill `state` (model, optimizer) from `checkpoint`, every value checked against what this
        optimizer writes; (its trainer state, this rank's RNG states or None)."""
        groups_written = copy.deepcopy(state["optim"].get("param_groups", []))  # what this optimizer writes
        trainer_state = read_trainer_state(checkpoint.path)
        check_trainer_state(trainer_state, STATE_NAME, checkpoint.step, expected_state)
        if check_state is not None:
            check_state(trainer_state)
        reader = JsonMetadataReader(checkpoint.path)
        never_stepped = _drop_unsaved_optimizer_state(state["optim"], reader)
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        check_param_groups(state["optim"].get("param_groups", []), groups_written)
        saved_params = {fqn for group in state["optim"]["param_groups"] for fqn in group["params"]}
        if not never_stepped <= saved_params:
            raise ValueError(f"no optimizer state for {sorted(never_stepped - saved_params)[0]}, which the "
                             "checkpoint's optimizer did not hold")
        rng_file = checkpoint.path / f"rng-rank{_rank()}.pt"
        return trainer_state, read_rng(rng_file) if rng_file.is_file() else None

    def set_aside_after(self, step: int) -> list[Path]:
        """Resuming from `step` abandons this run's newer checkpoints (a damaged one included):
        rename them (never delete) so that neither `resume auto` nor retention mistakes them
        for this run's latest."""
        moved = []
        if _rank() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for checkpoint in self.owned():
                if checkpoint.step > step:
                    target = checkpoint.path.with_name(f"abandoned-{checkpoint.path.name}-{stamp}")
                    checkpoint.path.rename(target)
                    moved.append(target)
        _barrier()
        return moved

    def _retain(self, written_step: int) -> None:
        """Delete this run's oldest checkpoints beyond `keep_last`, never one newer than the one
        just written and never another run's."""
        if self.keep_last <= 0:
            return
        mine = [c for c in self.owned() if c.step <= written_step]
        for old in mine[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)


def _recorded_run_id(path: Path) -> str | None:
    try:
        run_id = read_trainer_state(path).get("run_id")
    except (OSError, ValueError):
        return None  # no state, or a damaged one: verification names it at resume
    return run_id if isinstance(run_id, str) else None


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=1, sort_keys=True)
        fh.write("\n")


def _more(problems: list[str]) -> str:
    return f" and {len(problems) - 1} more" if len(problems) > 1 else ""


def _fsync_dir(path: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
