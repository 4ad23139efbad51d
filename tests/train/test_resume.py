"""Exact resume: a run killed with SIGKILL and resumed gives the per-step losses of an
uninterrupted run; SIGTERM saves a checkpoint and exits, and the run continues from it."""

from __future__ import annotations

import signal
import time

import pytest

from tests.train.run_helpers import losses, printed, run_in_fork, start


def _wait_for(predicate, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("recipe", ["tiny/sft_support_json", "tiny/lora_support_json"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, recipe):
    cache = tmp_path / "cache"
    straight = run_in_fork(tmp_path / "straight", cache, recipe=recipe)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    expected = losses(tmp_path / "straight")
    assert sorted(expected) == list(range(1, 9))
    assert expected[8] < expected[1]

    killed_dir = tmp_path / "killed"
    proc = start(killed_dir, cache, recipe=recipe)
    ckpt = killed_dir / "checkpoints" / "step-00000004"
    assert _wait_for(lambda: (ckpt / "checksums.json").is_file(), proc), proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = sorted(p.name for p in (killed_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert "step-00000008" not in done  # it really died mid-run

    resumed = run_in_fork(killed_dir, cache, "--checkpoint.resume", "auto", recipe=recipe)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert printed(resumed.stdout, "resumed from")
    assert losses(killed_dir) == expected  # bit-for-bit: same floats at every step


def test_sigterm_saves_and_resumes(tmp_path):
    cache = tmp_path / "cache"
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache, "--checkpoint.every_steps", "0")
    metrics = run_dir / "metrics.jsonl"
    assert _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output
    assert "SIGTERM: saved" in output
    saved = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) < 8
    resumed = run_in_fork(run_dir, cache, "--checkpoint.every_steps", "0", "--checkpoint.resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert sorted(losses(run_dir)) == list(range(1, 9))
