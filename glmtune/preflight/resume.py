"""Check 7: save, kill the process, resume in a fresh process, and get the uninterrupted run's loss.

A fresh `glmtune train` process runs the scratch recipe (the reference's `NUM_STEPS`
steps, so that the learning-rate schedule is the same) with a checkpoint after step 1.
As soon as that checkpoint is complete (its checksums.json exists: the manager writes it
last, then renames the directory into place) the process is killed with SIGKILL: no
handler runs, nothing is flushed. Another fresh process resumes with
`--checkpoint.resume auto` and trains step 2. Its loss and gradient norm must equal the
reference run's step 2 (`NUM_STEPS` steps in one process): exactly on the CPU in float32,
within `Preflight.tolerance()` otherwise. The killed process's step 1 must equal the
reference's too, so that a difference is the resume's, not two runs that never agreed.

If the first process finished before it could be killed (it ran step 2 in the time the
poll took), the evidence says so and the second process resumes from the step-1
checkpoint by path (the trainer sets the newer one aside).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glmtune.checkpoint.integrity import CHECKSUMS_NAME
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.preflight.runs import ReferenceRun, log_line, read_records, run, start

WAIT_SECONDS = 3600.0  # for the first checkpoint of a large model


def same(a: float, b: float, rel: float) -> bool:
    """`a` equals `b`, or is within `rel` of it (rel 0: the same float)."""
    return a == b if rel == 0 else math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def compare_steps(actual: dict[int, dict], expected: dict[int, dict], steps: list[int], rel: float,
                  what: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Problems and a row per step where `actual`'s loss and grad norm differ from `expected`'s."""
    problems, rows = [], []
    for step in steps:
        got, want = actual.get(step), expected.get(step)
        if got is None or want is None:
            problems.append(f"{what}: no step {step} record ({'run' if got is None else 'reference'})")
            continue
        row = {"step": step, "loss": got["loss"], "reference_loss": want["loss"],
               "grad_norm": got["grad_norm"], "reference_grad_norm": want["grad_norm"]}
        rows.append(row)
        for key in ("loss", "grad_norm"):
            if not same(got[key], want[key], rel):
                problems.append(f"{what}: step {step} {key} {got[key]!r}, the reference's {want[key]!r} "
                                f"(difference {got[key] - want[key]:.3g})")
    return problems, rows


def _wait_for(path: Path, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def check_resume(pf: Preflight, ref: ReferenceRun, tamper: Callable[[Path], None] | None = None) -> CheckResult:
    """Check 7; `tamper(checkpoint_dir)` runs between the kill and the resume (tests plant faults there)."""
    run_dir = pf.work / "resume"
    proc, log = start(pf, run_dir, "--checkpoint.every_steps", "1")
    checkpoint = run_dir / "checkpoints" / "step-00000001"
    _wait_for(checkpoint / CHECKSUMS_NAME, proc, WAIT_SECONDS)
    killed = proc.poll() is None
    if killed:
        proc.kill()
    proc.wait()
    before_kill = read_records(run_dir)
    evidence: dict[str, Any] = {"run_dir": str(run_dir), "log": str(log), "checkpoint": str(checkpoint),
                                "killed": "SIGKILL after the step-1 checkpoint was complete" if killed else
                                f"the process ended (status {proc.returncode}) before it could be killed"}
    if not (checkpoint / CHECKSUMS_NAME).is_file():
        why = log_line(log, "error") or f"exit status {proc.returncode}"
        return CheckResult(7, "fail", f"no complete checkpoint after step 1: {why}", evidence)
    evidence["checkpoint_files"] = {f.name: f.stat().st_size for f in sorted(checkpoint.iterdir())}
    if tamper is not None:
        tamper(checkpoint)
    source = "auto" if killed else str(checkpoint)
    status, log = run(pf, run_dir, "--checkpoint.every_steps", "1", "--checkpoint.resume", source)
    resumed = read_records(run_dir)
    evidence["resumed"] = log_line(log, "resumed from")
    rel, how = pf.tolerance()
    evidence["tolerance"] = how
    if status != 0 or evidence["resumed"] is None:
        why = log_line(log, "error") or log_line(log, "checkpoint") or f"exit status {status}"
        return CheckResult(7, "fail", f"the fresh process did not resume: {why}", evidence)
    problems, rows = compare_steps(before_kill, ref.records, [1], rel, "the killed process")
    resumed_problems, resumed_rows = compare_steps(resumed, ref.records, [2], rel, "after resuming")
    evidence["steps"] = rows + resumed_rows
    message = (f"killed after the step-1 checkpoint ({sum(evidence['checkpoint_files'].values()):,} bytes), "
               f"resumed in a fresh process ({source}): step 2 loss {resumed.get(2, {}).get('loss')!r} = the "
               f"uninterrupted run's ({how})")
    return verdict(7, problems + resumed_problems, message, evidence)
