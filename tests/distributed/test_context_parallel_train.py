"""`glmtune train` with context parallelism under torchrun (gloo, CPU), against one process.

Each cp rank reads the same rows and computes its slice of every row's queries
(glmtune/distributed/context_parallel.py); per-step losses, gradient norms and validation
losses equal the single-process run with the same global batch (relative 1e-5, fp32) for
both balances, and with expert parallelism over the dp_shard x cp ranks. The model-level
proofs (sparse top-k rows, every backend, cp 4) are tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.run_helpers import SMALL, env, run

STEPS = ["--train.max_steps", "4", "--checkpoint.every_steps", "2", "--train.val_every", "2"]


def _torchrun(nproc: int, run_dir: Path, cache: Path, *extra: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "glmtune", "train", "tiny/sft_support_json", *SMALL, "--logging.run_dir", str(run_dir),
           "--data.cache_dir", str(cache), *extra]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def _records(run_dir: Path) -> dict[int, tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss"), r["tokens"]) for r in rows}


def _assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step, values in expected.items():
        for got, want in zip(actual[step], values):
            assert (got is None) == (want is None), step
            if want is not None:
                assert got == pytest.approx(want, rel=1e-5), step


@pytest.mark.parametrize("balance", ["head_tail", "contiguous"])
def test_cp2_matches_one_process_and_resumes_without_cp(balance, tmp_path):
    cache = tmp_path / "cache"
    single = run(tmp_path / "single", cache, *STEPS)
    assert single.returncode == 0, single.stdout + single.stderr
    done = _torchrun(2, tmp_path / "cp", cache, *STEPS, "--parallel.cp", "2", "--parallel.cp_balance", balance)
    assert "x cp 2 x" in " ".join(done.stdout.split())
    expected = _records(tmp_path / "single")
    _assert_same(_records(tmp_path / "cp"), expected)  # token counts too: cp ranks share rows
    if balance == "head_tail":  # the cp 2 checkpoint of step 2, continued in one process
        layout = tmp_path / "resume"
        shutil.copytree(tmp_path / "cp", layout)
        shutil.rmtree(layout / "checkpoints" / "step-00000004")
        resumed = run(layout, cache, *STEPS, "--checkpoint.resume", "auto")
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout
        _assert_same(_records(layout), expected)


def test_cp2_with_ep2_over_the_sharded_ranks(tmp_path):
    cache = tmp_path / "cache"
    batch = ["--train.global_batch_size", "8", "--train.val_every", "0"]
    single = run(tmp_path / "single", cache, *STEPS, *batch)
    assert single.returncode == 0, single.stdout + single.stderr
    done = _torchrun(4, tmp_path / "cp", cache, *STEPS, *batch, "--parallel.cp", "2", "--parallel.ep", "2")
    described = " ".join(done.stdout.split())  # the console wraps long lines
    assert "dp_shard 2 x cp 2" in described and "ep 2 (expert FSDP 2)" in described
    _assert_same(_records(tmp_path / "cp"), _records(tmp_path / "single"))
