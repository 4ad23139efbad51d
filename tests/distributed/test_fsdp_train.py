"""`glmtune train` under torchrun with 2 processes (gloo, CPU): FSDP2 data parallelism gives
the per-step losses of the single-process run with the same global batch, saves a sharded
DCP checkpoint that resumes, and exports an HF checkpoint equal to the trained weights.

The 2-process run is the one `glmtune train --nproc-per-node 2` starts (shared with
tests/cli/test_train_launch.py); its resume is started by torchrun directly."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from glmtune import load_pretrained
from tests.train.run_helpers import SMALL, WITH_EXPORT, env, losses, shared_run

STEPS = WITH_EXPORT  # 4 steps, checkpoints after steps 2 and 4, the HF export


def _torchrun(run_dir, cache, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "glmtune", "train", "tiny/sft_support_json", *SMALL, *STEPS, "--logging.run_dir", str(run_dir),
           "--data.cache_dir", str(cache), *extra]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)


def test_two_process_fsdp_matches_single_process(tmp_path, shared_results):
    single = shared_run(shared_results, *STEPS)
    double = shared_run(shared_results, *STEPS, "--nproc-per-node", "2")
    assert "world 2 = dp_replicate 1 x dp_shard 2" in double.stdout

    expected, actual = losses(single.run_dir), losses(double.run_dir)
    assert sorted(actual) == [1, 2, 3, 4]
    for step in expected:  # same rows per step; only the reduction order differs
        assert actual[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-4)

    # The sharded checkpoint holds every rank's part and the export is the full model.
    assert (double.run_dir / "checkpoints" / "step-00000004" / "trainer_state.json").is_file()
    exported = load_pretrained(double.run_dir / "hf", dtype=torch.float32)
    reference = load_pretrained(single.run_dir / "hf", dtype=torch.float32)
    for (name, a), (_, b) in zip(exported.state_dict().items(), reference.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), name

    fsdp = shutil.copytree(double.run_dir, tmp_path / "fsdp")
    resumed = _torchrun(fsdp, double.cache_dir, "--train.max_steps", "6", "--checkpoint.resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert sorted(losses(fsdp)) == [1, 2, 3, 4, 5, 6]
