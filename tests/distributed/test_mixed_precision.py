"""bf16 runs under FSDP2 (2 processes, gloo, CPU) at the GLM-5 recipes' lr 1e-5.

bf16-only parameters start and train (the fp32 router is a unit of its own), warn at
start, and leave most weights bit-for-bit unchanged. The default, bf16 parameters with
fp32 masters held by the optimizer, moves every weight that an fp32 run moves (its
checkpoint holds the masters) and follows the fp32 run's loss curve; sharded over 2
processes it gives the one-process losses exactly. The runs are `glmtune train` through the CLI's
entry point in processes forked with torch and glmtune imported (tests/distributed/forked_runs.py):
the one-process runs in one process, one after another, the sharded ones on 2 gloo ranks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from glmtune.checkpoint.manager import CheckpointManager
from glmtune.config import load_config
from glmtune.train.model_source import build_model_from_config
from tests.distributed.forked_runs import train_in_forks
from tests.train.run_helpers import losses

LR_1E5 = ["--train.max_steps", "4", "--optim.lr", "1e-5", "--optim.warmup_steps", "0", "--optim.scheduler",
          "constant", "--checkpoint.export_hf", "true"]
BF16 = ["--model.dtype", "bfloat16"]
BF16_ONLY = [*BF16, "--train.master_weights", "none"]


def _output(run_dir: Path) -> str:
    """The run's console output (rank 0's), rich's wrapped lines joined."""
    return " ".join((run_dir.parent / f"{run_dir.name}.out").read_text().split())


def _changed(run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """Per trainable parameter, which entries the run changed: the weights its last checkpoint
    holds (the fp32 masters when there are any; the HF export is cast to model.dtype), read into
    fp32, against the initial model."""
    initial, _ = build_model_from_config(load_config("tiny/sft_support_json", list(overrides)), "cpu")
    initial = initial.float()  # exact: the start in fp32
    final = copy.deepcopy(initial)
    manager = CheckpointManager(run_dir / "checkpoints")
    manager.load(manager.latest(), final, torch.optim.AdamW(final.parameters()))
    finals = dict(final.named_parameters())
    return {name: finals[name] != param for name, param in initial.named_parameters() if param.requires_grad}


def test_bf16_only_parameters_train_under_fsdp2_warn_and_leave_most_weights_unchanged(tmp_path):
    train_in_forks({tmp_path / "run": [*LR_1E5, *BF16_ONLY]}, tmp_path / "cache", nproc=2)
    out = _output(tmp_path / "run")
    assert "bf16 parameters and compute; world 2" in out
    assert "at optim.lr 1e-05 most bf16 weights do not move: 85% of updates round away" in out
    curve = losses(tmp_path / "run")
    assert sorted(curve) == [1, 2, 3, 4] and all(8.0 < loss < 9.0 for loss in curve.values())

    changed = _changed(tmp_path / "run", *BF16_ONLY)
    routers = [name for name in changed if name.endswith("mlp.gate.weight")]
    assert routers and all(changed[name].all() for name in routers)  # fp32, so every update lands
    moved = sum(int(mask.sum()) for mask in changed.values())
    total = sum(mask.numel() for mask in changed.values())
    assert moved / total < 0.2  # measured 11%: 89% of the trainable weights never moved in 4 steps


def test_default_fp32_master_weights_move_every_weight_and_follow_the_fp32_curve(tmp_path):
    """All three runs start from the same bf16 weights (the preset base the first run writes, as a
    GLM-5 checkpoint is bf16): fp32 parameters and compute, bf16 with fp32 masters in one process,
    and sharded over 2 processes."""
    cache, twelve = tmp_path / "cache", ["--train.max_steps", "12"]
    base = ["--model.name_or_path", str(tmp_path / "single" / "base")]
    train_in_forks({tmp_path / "single": [*LR_1E5, *twelve, *BF16],  # one process: no FSDP2
                    tmp_path / "fp32": [*LR_1E5, *twelve, *base, "--model.dtype", "float32"]}, cache)
    train_in_forks({tmp_path / "sharded": [*LR_1E5, *twelve, *BF16]}, cache, nproc=2)
    sharded = _output(tmp_path / "sharded")
    assert "bf16 parameters and compute, fp32 master weights in the optimizer; world 2" in sharded
    assert "round away" not in sharded

    # Sharding the masters changes nothing: the same bf16 weights; the one process adds its two
    # micro-batches' bf16 gradients (one rounding), FSDP2 sums the ranks' in fp32 and rounds once.
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "single"), rel=1e-6)
    # From bf16 weights an update shows in bf16 compute once a master has moved half a bf16 spacing:
    # the curve lags the fp32 one for a few steps, then follows it. Measured over 16 steps: fp32 falls
    # 0.23 by step 12; the masters' curve is within 0.015 of it from step 8 on; bf16-only parameters
    # stay 0.2 above.
    fp32, mixed = losses(tmp_path / "fp32"), losses(tmp_path / "sharded")
    drop = fp32[1] - fp32[12]
    assert drop > 0.15
    for step in range(9, 13):
        assert abs(mixed[step] - fp32[step]) < 0.1 * drop, (step, mixed[step], fp32[step])

    reference_moved = _changed(tmp_path / "fp32", *base, "--model.dtype", "float32")
    for run_dir in ("single", "sharded"):
        changed = _changed(tmp_path / run_dir, *BF16)
        moved = sum(int((changed[name] & mask).sum()) for name, mask in reference_moved.items())
        total = sum(int(mask.sum()) for mask in reference_moved.values())
        assert moved / total > 0.9999, (run_dir, moved, total)  # the masters in the checkpoint moved
