"""`glmtune train` with context parallelism under torchrun (gloo, CPU), against one process.

Each cp rank reads the same rows and computes its slice of every row's queries
(glmtune/distributed/context_parallel.py); per-step losses, gradient norms and validation
losses equal the single-process run with the same global batch (relative 1e-5, fp32) for
both balances, and with expert parallelism over the dp_shard x cp ranks. The model-level
proofs (sparse top-k rows, every backend, cp 4) are tests/distributed/test_context_parallel.py.
The layouts' runs are `glmtune train` through the CLI's entry point on gloo ranks forked with torch
and glmtune imported (tests/distributed/forked_runs.py), as torchrun starts them.
"""

from __future__ import annotations

import shutil

import pytest

from tests.distributed.forked_runs import train_in_forks
from tests.train.run_helpers import (BATCH_8_WITH_EXPORT, FOUR_STEPS, WITH_VALIDATION, assert_same_steps, printed,
                                    shared_run, step_records)

STEPS = WITH_VALIDATION  # the one-process reference: tests/train/run_helpers.py


@pytest.mark.parametrize("balance", ["head_tail", "contiguous"])
def test_cp2_matches_one_process_and_resumes_without_cp(balance, tmp_path, shared_results):
    single = shared_run(shared_results, *STEPS)
    cache = single.cache_dir
    train_in_forks({tmp_path / "cp": [*STEPS, "--parallel.cp", "2", "--parallel.cp_balance", balance]}, cache, nproc=2)
    assert "x cp 2 x" in " ".join((tmp_path / "cp.out").read_text().split())
    expected = step_records(single.run_dir)
    assert_same_steps(step_records(tmp_path / "cp"), expected)  # token counts too: cp ranks share rows
    if balance == "head_tail":  # the cp 2 checkpoint of step 2, continued in one process
        layout = tmp_path / "resume"
        shutil.copytree(tmp_path / "cp", layout)
        shutil.rmtree(layout / "checkpoints" / "step-00000004")
        train_in_forks({layout: [*STEPS, "--checkpoint.resume", "auto"]}, cache)  # one process, no group
        assert printed((tmp_path / "resume.out").read_text(), "resumed from")
        assert_same_steps(step_records(layout), expected)


def test_cp2_with_ep2_over_the_sharded_ranks(tmp_path, shared_results):
    single = shared_run(shared_results, *BATCH_8_WITH_EXPORT)  # no validation; its HF export is not read here
    batch = ["--train.global_batch_size", "8", "--parallel.cp", "2", "--parallel.ep", "2"]
    train_in_forks({tmp_path / "cp": [*FOUR_STEPS, *batch]}, single.cache_dir, nproc=4)
    described = " ".join((tmp_path / "cp.out").read_text().split())  # the console wraps long lines
    assert "dp_shard 2 x cp 2" in described and "ep 2 (expert FSDP 2)" in described
    assert_same_steps(step_records(tmp_path / "cp"), step_records(single.run_dir))
