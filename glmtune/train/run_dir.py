"""One run per run directory: a lock for the run's life, the run's identity, no mixed runs.

`glmtune train` claims `logging.run_dir` before it writes anything:
  * a lock (`.glmtune.lock`, flock) held while the run lives; a second run into the
    same directory is refused with the holder's pid, host and start time. A run that
    ends (finished or failed) marks the file released; one that was killed leaves its
    line there with the flock gone, and the next run takes such a stale lock over (and
    says so);
  * the run's identity in `run.json` (a run id that every checkpoint records, so
    resuming, retention and `--overwrite` only ever touch this run's checkpoints);
  * a directory holds a glmtune run when it has both `run.json` (with a run id) and
    `.glmtune.lock`. One without them that has files a run writes (a home directory
    with its own `config.yaml` or `hf/`) is refused, `--overwrite` or not;
  * a fresh start (`checkpoint.resume none`) into a directory that holds an earlier run's
    checkpoints, or a different resolved config, is refused unless the user resumes it
    or passes `--overwrite`, which replaces that run's checkpoints and outputs (the files
    `glmtune train` writes, nothing else) and says so. In a checkpoint directory shared
    by several runs, only checkpoints recording this run's id go, and a `.partial` save
    or an abandoned checkpoint only when it is provably this run's (its name or trainer
    state carries the run id: `CheckpointManager.owned_leftovers`); the rest stay, named.
    The earlier run is set aside, not removed, until the new run has passed every check
    (`overwrite.SetAside`: `commit` removes it before the first step; a run that
    ends before that moves it back), and an input of the new run that lies among the files
    it would replace is refused;
  * a resume (`checkpoint.resume auto`) that finds none of the run's checkpoints is refused
    when the directory holds what a finished run leaves (hf/, the adapters, samples.json):
    starting again at step 0 would replace them;
  * a resume writes the run's config.yaml and record only when it trains (`commit`): one refused
    before (a missing data file) leaves them as the run trained with;
  * checkpoint.dir may not lie inside a file the run writes whole (hf/, tensorboard/, ...);
  * the run and checkpoint directories must be writable, checked with a probe file.

The lock's mechanics, the run record and the stop file are glmtune/io/run_lock.py's (other
commands read them too); what needs the checkpoint manager (the claim, `--overwrite`) is here.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


from glmtune.checkpoint.manager import CheckpointManager
from glmtune.config import JobConfig, dump_config
from glmtune.config.yaml_layers import load_yaml_text
from glmtune.io.run_lock import LOCK_FILE, RUN_FILE, STOP_FILE, RunLock, read_run_record, write_run_record
from glmtune.train.overwrite import SetAside, recover

# What `glmtune train` writes into a run directory besides checkpoints; `--overwrite`
# removes these and nothing else (data/ is content-addressed and safe to reuse).
RUN_OUTPUTS = ("config.yaml", RUN_FILE, "metrics.jsonl", "tensorboard", "trainable.json", "data_manifest.json",
               "pii_report.json", "samples.json", "hf", "base", "adapter", "adapter_per_expert", STOP_FILE)
# What a run writes when it finishes: its trained weights and the after-training samples. A run that
# restarts at step 0 (nothing to resume from) would replace them.
FINISHED_OUTPUTS = ("hf", "adapter", "adapter_per_expert", "samples.json")


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


def config_changes(saved_yaml: str, new_yaml: str, null_means: Mapping[str, Callable[[], Any]] | None = None
                   ) -> list[str]:
    """`key: old -> new` for every resolved setting that differs (locations and resume aside); a key of
    `null_means` that is null on one side only is compared as what the null resolves to."""
    old = _flatten(load_yaml_text(saved_yaml, "the run's config.yaml") or {})
    new = _flatten(load_yaml_text(new_yaml, "the resolved config") or {})

    def differs(key: str) -> bool:
        a, b = old.get(key), new.get(key)
        if a != b and key in (null_means or {}) and (a is None) != (b is None):
            resolved = null_means[key]()
            a, b = (resolved if a is None else a), (resolved if b is None else b)
        return a != b

    return [f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
            for key in sorted(old.keys() | new.keys()) if key not in _NOT_THE_RUN and differs(key)]


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
        self._lock = RunLock(self.run_dir)
        self._aside: SetAside | None = None  # the earlier run, while an --overwrite has not committed
        self.continued = False  # the claim resumes the run the directory holds
        self._pending_record: dict[str, Any] | None = None  # a resume's record, written when it commits

    def lock(self) -> None:
        """Take the run directory's lock (kept until `release`) or name its holder."""
        check_writable(self.run_dir, "logging.run_dir", create=True)
        try:
            stale = self._lock.acquire()
        except ValueError as holder:
            raise ValueError(f"logging.run_dir {self.run_dir} is in use by {holder}; wait for that run to end "
                             "or choose another --logging.run_dir") from None
        if stale:
            self.say(f"logging.run_dir {self.run_dir}: taking over the stale lock of {stale} (that process "
                     "ended without releasing it)")

    def release(self) -> None:
        """End the claim: an --overwrite that did not commit moves the earlier run back; a run that
        claimed the directory marks its lock released; a refused one removes the lock file it
        created (and leaves one that was there as it was)."""
        try:
            if self._aside is not None and not self._aside.committed:
                self._aside.rollback(self._outputs_present())
                self.say(f"--overwrite: the run stopped before training; moved run {self._aside.run_id}'s "
                         f"files back into {self.run_dir}")
                self._aside = None
        finally:
            self._lock.release()

    def commit(self) -> None:
        """The run passed its checks and trains: a resume's record is written; an --overwrite removes the
        earlier run it set aside."""
        if self._pending_record is not None:
            write_run_record(self.run_dir, {**(read_run_record(self.run_dir) or {}), **self._pending_record})
            self._pending_record = None
        if self._aside is not None:
            removed = self._aside.commit()
            where = self.run_dir if self.checkpoint_dir.parent == self.run_dir \
                else f"{self.run_dir} and {self.checkpoint_dir}"
            self.say(f"--overwrite: removed the previous run's files from {where}: {', '.join(removed)}")

    def bytes_set_aside(self) -> dict[Path, int]:
        """What committing the --overwrite frees, by directory (the disk check counts it free)."""
        return self._aside.bytes_held() if self._aside is not None else {}

    def claim(self, config_yaml: str, resume: str, overwrite: bool, inputs: tuple[tuple[str, str], ...] = (),
              null_means: Mapping[str, Callable[[], Any]] | None = None) -> str:
        """Decide whose run this directory holds; returns the run id this process trains as.

        Raises ValueError (before anything is written) when the directory holds files a run
        writes but no glmtune run, when a fresh start would mix with an earlier run and
        `overwrite` is not set, or when one of `inputs` ((setting, path) the run reads) lies
        among the files it would replace.
        """
        assert self._lock.held, "lock() first"
        self._refuse_checkpoints_among_outputs()
        recover(self.run_dir, self.checkpoint_dir, self._outputs_present, self.say)
        record, not_a_run = self._previous_run()
        fresh = resume in ("none", "", None)
        if record is None:
            self._refuse_foreign_files(not_a_run, overwrite)
        elif overwrite:
            self._set_aside_previous_run(record["run_id"], inputs)
        elif fresh:
            self._refuse_mixed_run(record["run_id"], config_yaml, null_means)
        else:
            self._refuse_inputs_among([self.run_dir / n for n in FINISHED_OUTPUTS], inputs, "replaces when it "
                                      "finishes")
            if resume == "auto":
                self._refuse_restart_over_outputs(record["run_id"])
            if (self.run_dir / "config.yaml").is_file():
                changed = config_changes((self.run_dir / "config.yaml").read_text(encoding="utf-8"), config_yaml,
                                         null_means)
                if changed:
                    self.say("resuming with changed settings: " + "; ".join(changed))
        continued = record if (record and not fresh and not overwrite) else None
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        run_id = continued["run_id"] if continued else uuid.uuid4().hex[:16]
        self._lock.mark()
        written = {"run_id": run_id, "started": now, "created": continued.get("created", now) if continued else now}
        self.continued = continued is not None
        if self.continued:  # a resume refused before it trains leaves the run's record as it was
            self._pending_record = written
        else:
            write_run_record(self.run_dir, written)
        return run_id

    def _previous_run(self) -> tuple[dict[str, Any] | None, str]:
        """(the earlier run's record, "") when the directory holds a glmtune run, else (None, why not)."""
        try:
            record = read_run_record(self.run_dir)
        except ValueError:
            return None, f"its {RUN_FILE} is not a glmtune run record"
        if record is None:
            return None, f"no {RUN_FILE}"
        if not self._lock.existed:  # a copy made with `cp -r RUN/*` leaves the lock behind
            return None, f"a {RUN_FILE} but no {LOCK_FILE}: a copy of a run directory needs both"
        return record, ""

    def _refuse_foreign_files(self, not_a_run: str, overwrite: bool) -> None:
        """No glmtune run here: refuse if training would write over (or `--overwrite` remove) files."""
        found = [name for name in RUN_OUTPUTS if os.path.lexists(self.run_dir / name)]
        if found:
            verb = "remove" if overwrite else "replace"
            raise ValueError(f"logging.run_dir {self.run_dir} does not hold a glmtune run ({not_a_run}), yet has "
                             f"files a run would {verb}: {', '.join(found)}; choose another --logging.run_dir, "
                             "or move those files away")
        legacy = [c for c in CheckpointManager(self.checkpoint_dir).complete() if c.run_id is None]
        if legacy:  # a new run would take them for its own (resume auto, retention)
            raise ValueError(f"checkpoint.dir {self.checkpoint_dir} holds checkpoints that record no run (up to "
                             f"step {legacy[-1].step}); choose another --checkpoint.dir, or move them away")

    def _refuse_mixed_run(self, run_id: str, config_yaml: str,
                          null_means: Mapping[str, Callable[[], Any]] | None = None) -> None:
        """A fresh start into a directory holding run `run_id`: refused if it would mix with that run."""
        reasons = []
        earlier = CheckpointManager(self.checkpoint_dir, run_id=run_id).owned()
        if earlier:
            reasons.append(f"checkpoints up to step {earlier[-1].step} in {self.checkpoint_dir}")
        saved_config = self.run_dir / "config.yaml"
        changed = config_changes(saved_config.read_text(encoding="utf-8"), config_yaml, null_means) \
            if saved_config.is_file() else []
        if changed:
            reasons.append(f"a different config ({changed[0]}" + (f", and {len(changed) - 1} more)"
                                                                  if len(changed) > 1 else ")"))
        if reasons:
            raise ValueError(f"logging.run_dir {self.run_dir} already holds another run ({'; '.join(reasons)}); "
                             "continue it with --checkpoint.resume auto, start a new run in another "
                             "--logging.run_dir, or replace this one with --overwrite (removes only that run's "
                             "checkpoints and outputs)")

    def _refuse_restart_over_outputs(self, run_id: str) -> None:
        """`resume auto` into run `run_id` with none of its checkpoints left: it would start again at
        step 0 and, at its end, replace the outputs the finished run left (its only trained weights
        when it was trained with checkpoint.save_at_end false). Refused while any of them is there; a
        run that died before its first checkpoint left none, and restarts (a requeued job)."""
        if CheckpointManager(self.checkpoint_dir, run_id=run_id).owned():
            return
        found = [name for name in FINISHED_OUTPUTS if os.path.lexists(self.run_dir / name)]
        if found:
            raise ValueError(f"checkpoint.resume auto: no checkpoint of the run in {self.run_dir} is left in "
                             f"{self.checkpoint_dir} to resume from, and starting again at step 0 would replace "
                             f"the finished run's outputs ({', '.join(found)}); keep them and train in another "
                             "--logging.run_dir, or start this run over with --overwrite")

    def _refuse_checkpoints_among_outputs(self) -> None:
        """checkpoint.dir at or inside a file the run writes whole (hf/ is replaced by the export at the
        end, tensorboard/ and the rest by --overwrite): its checkpoints would go with it."""
        where = self.checkpoint_dir.resolve()
        for name in RUN_OUTPUTS:
            output = (self.run_dir / name).resolve()
            if where == output or output in where.parents:
                raise ValueError(f"checkpoint.dir {self.checkpoint_dir} is inside {self.run_dir / name}, which the "
                                 "run replaces whole; choose another --checkpoint.dir (the default is "
                                 "RUN_DIR/checkpoints)")

    def _outputs_present(self) -> list[Path]:
        return [self.run_dir / n for n in RUN_OUTPUTS if os.path.lexists(self.run_dir / n)]

    def _refuse_inputs_among(self, replaced: list[Path], inputs, does: str) -> None:
        """One of `inputs` ((setting, path)) at, inside or holding a file of `replaced`: refused."""
        for key, value in inputs:
            source = Path(value).resolve()
            for path in replaced:
                target = path.resolve()
                if os.path.lexists(path) and (source == target or target in source.parents
                                              or source in target.parents):
                    raise ValueError(f"{key} {value} is among the files of the earlier run in {self.run_dir} that "
                                     f"this run {does} ({path}); copy it out of the run directory first, or "
                                     "choose another --logging.run_dir")

    def _set_aside_previous_run(self, run_id: str, inputs) -> None:
        """--overwrite: run `run_id`'s checkpoints and outputs are set aside (removed when the new run
        commits, moved back if it does not); what other runs wrote, and what nothing ties to this run,
        stays (named, when it looks like a checkpoint)."""
        manager = CheckpointManager(self.checkpoint_dir, run_id=run_id)
        complete = manager.complete()
        mine = [c.path for c in complete if c.run_id == run_id] + manager.owned_leftovers()
        outputs = self._outputs_present()
        self._refuse_inputs_among([*outputs, *mine], inputs, "would replace (--overwrite)")
        self._aside = SetAside(self.run_dir, self.checkpoint_dir, run_id)
        self._aside.move(outputs, mine)
        if outputs or mine:
            names = ", ".join(p.name for p in [*outputs, *mine])
            self.say(f"--overwrite: set the previous run's files aside ({names}); they are removed when this run "
                     "starts training, and put back if it stops before")
        left = sorted(c.path.name for c in complete if c.run_id is None)
        if self.checkpoint_dir.is_dir():
            left += sorted(p.name for p in [*self.checkpoint_dir.glob(".step-*.partial"),
                                            *self.checkpoint_dir.glob("abandoned-step-*")] if p not in mine)
        if left:
            self.say(f"--overwrite: left {', '.join(left)} in {self.checkpoint_dir}: not provably this run's "
                     "(another run's save in progress or set-aside checkpoint, or from an older glmtune)")


def save_run_config(cfg: JobConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
