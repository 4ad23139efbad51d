"""Stop requests: SIGUSR1 (Slurm's warning before the time limit) stops like SIGTERM, and so
does the stop file, which rank 0 removes once the checkpoint is saved. Each finishes the
step, saves one checkpoint and ends the run as interrupted (exit status 130). A SIGINT that the
process was started with ignored is no stop request."""

from __future__ import annotations

import os
import signal

from tests.train.run_helpers import start
from tests.train.test_resume import _wait_for
from tests.train.test_trainer import _loss, _trainer


def test_a_stop_file_present_at_start_stops_after_the_first_step_and_is_removed(tmp_path):
    """Not removed at start: a request that came while the job started up still counts."""
    trainer = _trainer(tmp_path, micro=2, accum=1, steps=4)
    trainer.s.stop_file = tmp_path / "STOP_REQUESTED"
    trainer.s.stop_file.touch()
    result = trainer.fit()
    assert result.interrupted and result.step == 1
    assert [c.step for c in trainer.checkpoints.complete()] == [1]
    assert not trainer.s.stop_file.exists()  # a requeued run must not stop at once


def _signalled_in_step_2(signum: int, calls: dict):
    """A loss function that sends this process `signum` in the second step's micro-batch (`calls["n"]`
    counts its calls)."""
    calls["n"] = 0

    def loss(model, mb):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signum)
        return _loss(model, mb)
    return loss


def test_sigusr1_finishes_the_step_and_saves(tmp_path):
    signalled_in_step_2 = _signalled_in_step_2(signal.SIGUSR1, {})
    before = signal.getsignal(signal.SIGUSR1)
    trainer = _trainer(tmp_path, micro=2, accum=1, loss_fn=signalled_in_step_2, steps=5)
    trainer.s.stop_file = tmp_path / "STOP_REQUESTED"  # absent: only the signal asks
    result = trainer.fit()
    assert result.interrupted and result.step == 2 and len(result.losses) == 2
    assert [c.step for c in trainer.checkpoints.complete()] == [2]
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is the loop's only


def test_a_sigint_the_process_was_started_with_ignored_stays_ignored_in_training(tmp_path):
    """A shell without job control starts `glmtune train ... &` with SIGINT ignored: before training
    nothing handles it (Python installs no handler), so the loop does not either."""
    calls: dict = {}
    signalled_in_step_2 = _signalled_in_step_2(signal.SIGINT, calls)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer = _trainer(tmp_path, micro=2, accum=1, loss_fn=signalled_in_step_2, steps=4)
        result = trainer.fit()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert not result.interrupted and result.step == 4 and calls["n"] == 4


def test_sigusr1_to_a_run_saves_and_exits_130(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    proc = start(run_dir, cache, "--checkpoint.every_steps", "0")
    metrics = run_dir / "metrics.jsonl"
    assert _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, proc)
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output
    assert "SIGUSR1: saved" in output
    saved = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) < 8
