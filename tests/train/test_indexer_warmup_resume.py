"""Exact resume across the indexer warm-up (`train.indexer_warmup_steps`, issue 34).

The tiny recipe (fp32, one process) with both auxiliary losses on (a trainable indexer,
`train.indexer_loss_weight 0.01`, and `train.mtp_loss_weight 0.3`, whose MTP layer trains after the
warm-up), a warm-up of W = 2 steps (dense attention, only the indexers train), top-k 64 on rows of 256
tokens (so the sparse steps select) and the router-bias update on (`sign`, which waits out the
warm-up: `TrainerSettings.router_bias_after`), 4 steps with a checkpoint after every one. A copy
of that run stopped after step 1 (inside the warm-up) or after step W (its last step) and resumed
gives the uninterrupted run's later steps bit for bit (loss, indexer KL, MTP loss and acceptance,
gradient norm, routing statistics), the switch to sparse training of everything at step W + 1 included, and the same
final checkpoint: every weight, router bias and optimizer state.

A warm-up checkpoint holds no optimizer state for the main weights (they have no gradient before
step W + 1): the resume loads those weights' state as absent, as it was, not as the state DCP
makes up for a fresh optimizer (step 1, zero moments), which would be refused as missing from
the checkpoint or change every later update.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from glmtune.checkpoint.dcp_storage import JsonMetadataReader
from glmtune import load_pretrained
from glmtune.checkpoint.manager import CheckpointManager, DamagedCheckpointError
from tests.train.run_helpers import run_in_fork, shared_run

WARMUP = 2
FLAGS = ["--model.indexer_trainable", "true", "--train.indexer_loss_weight", "0.01",
         "--train.indexer_warmup_steps", str(WARMUP), "--model.overrides.index_topk", "64",
         "--train.router_bias_update", "sign", "--train.max_steps", "4", "--checkpoint.every_steps", "1",
         "--train.mtp_loss_weight", "0.3", "--checkpoint.export_hf", "true"]
COMPARED = ("loss", "indexer_kl", "mtp_loss", "mtp_acceptance", "queries", "grad_norm", "lr", "tokens",
            "supervised_tokens")
BIASES = [f"model.model.layers.{layer}.mlp.gate.e_score_correction_bias" for layer in (2, 3)]  # the MoE layers
MAIN_WEIGHT_STATE = "optim.state.model.embed_tokens.weight.exp_avg"


@pytest.fixture(scope="module")
def straight(shared_results):
    return shared_run(shared_results, *FLAGS)


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _compared(record: dict) -> dict:
    """What a step must reproduce exactly: its losses, counts and routing statistics (not its timings)."""
    return {k: v for k, v in record.items() if k in COMPARED or k.startswith("moe/")}


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def _saved_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (the model's and the optimizer's), by its DCP key."""
    metadata = JsonMetadataReader(checkpoint).read_metadata().state_dict_metadata
    state = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=JsonMetadataReader(checkpoint), no_dist=True,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))  # tensors only
    return state


def test_the_reference_warms_up_the_indexers_then_trains_everything(straight):
    records = _records(straight.run_dir)
    assert sorted(records) == [1, 2, 3, 4]
    assert all(records[step]["indexer_kl"] > 0 and records[step]["mtp_loss"] > 0 for step in records)
    # the warm-up's gradient is the indexers' alone (weight 0.01): tiny; then everything trains
    grad_norms = [records[step]["grad_norm"] for step in (1, 2, 3, 4)]
    assert max(grad_norms[:WARMUP]) < 1e-3 < min(grad_norms[WARMUP:])
    saved = {step: _saved_tensors(_checkpoint(straight.run_dir, step)) for step in (1, 2, 3)}
    # the router biases wait out the warm-up (still the base's zeros after step W), then move
    for name in BIASES:
        assert torch.count_nonzero(saved[1][name]) == torch.count_nonzero(saved[2][name]) == 0, name
        assert torch.count_nonzero(saved[3][name]) > 0, name
    # what a warm-up checkpoint lacks: optimizer state for the main weights (never stepped)
    assert MAIN_WEIGHT_STATE not in saved[1] and MAIN_WEIGHT_STATE not in saved[2] and MAIN_WEIGHT_STATE in saved[3]
    assert "optim.state.model.layers.0.self_attn.indexer.wk.weight.exp_avg" in saved[1]


@pytest.mark.parametrize("stopped_after", [1, WARMUP], ids=["inside-warmup", "at-warmup-end"])
def test_resume_from_a_warmup_checkpoint_matches_uninterrupted(straight, tmp_path, stopped_after):
    run_dir = tmp_path / "run"
    shutil.copytree(straight.run_dir, run_dir)
    for step in range(stopped_after + 1, 5):  # what a run stopped after `stopped_after` left
        shutil.rmtree(_checkpoint(run_dir, step))
    done = run_in_fork(run_dir, straight.cache_dir, *FLAGS, "--checkpoint.resume", "auto")
    assert done.returncode == 0, done.stdout + done.stderr
    unwrapped = "".join(done.stdout.split())  # the console wraps long lines, paths too
    assert f"resumedfrom{_checkpoint(run_dir, stopped_after)}atstep{stopped_after}" in unwrapped, done.stdout
    expected, actual = _records(straight.run_dir), _records(run_dir)
    assert sorted(actual) == [1, 2, 3, 4]
    for step in range(stopped_after + 1, 5):  # the steps trained after the resume: the same floats
        assert _compared(actual[step]) == _compared(expected[step]), step
        assert any(key.startswith("moe/") for key in _compared(actual[step]))
    # the same final state: every weight, router bias and optimizer state, bit for bit
    want, got = _saved_tensors(_checkpoint(straight.run_dir, 4)), _saved_tensors(_checkpoint(run_dir, 4))
    assert got.keys() == want.keys() and MAIN_WEIGHT_STATE in want and set(BIASES) <= want.keys()
    for name in BIASES:
        assert torch.count_nonzero(want[name]) > 0 and torch.equal(got[name], want[name]), name
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_parameters_the_optimizer_never_stepped_resume_without_state(tmp_path):
    """The checkpoint manager alone: a parameter the saved optimizer held but never stepped (no
    gradient yet) comes back without optimizer state, as it was; one the saved optimizer did not
    hold at all (it was frozen) is still refused."""
    model = _two_layers()
    optimizer = torch.optim.AdamW(model.parameters())
    model[1](torch.randn(3, 4)).sum().backward()  # layer 0 gets no gradient
    optimizer.step()
    manager = CheckpointManager(tmp_path / "held")
    manager.save(1, model, optimizer, {})
    resumed = _two_layers()
    fresh = torch.optim.AdamW(resumed.parameters())
    manager.load(manager.latest(), resumed, fresh)
    assert {name: sorted(fresh.state[p]) for name, p in resumed.named_parameters()} == {
        "0.weight": [], "0.bias": [], "1.weight": ["exp_avg", "exp_avg_sq", "step"],
        "1.bias": ["exp_avg", "exp_avg_sq", "step"]}
    for name, param in resumed.named_parameters():
        torch.testing.assert_close(param, dict(model.named_parameters())[name], rtol=0, atol=0)
    assert torch.equal(fresh.state[resumed[1].weight]["exp_avg"], optimizer.state[model[1].weight]["exp_avg"])

    model[0].weight.requires_grad_(False)
    frozen = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(3, 4)).sum().backward()
    frozen.step()
    manager = CheckpointManager(tmp_path / "frozen")
    manager.save(1, model, frozen, {})
    resumed = _two_layers()
    with pytest.raises(DamagedCheckpointError, match="no optimizer state for 0.weight"):
        manager.load(manager.latest(), resumed, torch.optim.AdamW(resumed.parameters()))


def test_the_export_holds_the_trained_indexers_and_mtp_layer(straight):
    """The HF export's indexers and MTP layer are the last checkpoint's weights (step 4), bit for bit,
    and both moved from the base's."""
    final = _saved_tensors(_checkpoint(straight.run_dir, 4))
    exported = dict(load_pretrained(straight.run_dir / "hf", torch.float32, "cpu").named_parameters())
    base = dict(load_pretrained(straight.run_dir / "base", torch.float32, "cpu").named_parameters())
    names = [n for n in exported if ".indexer." in n or n.startswith("mtp.")]
    assert any(".indexer." in n for n in names) and any(n.startswith("mtp.") for n in names)
    for name in names:
        assert torch.equal(exported[name], final[f"model.{name}"]), name
    moved = {n for n in names if not torch.equal(exported[n], base[n])}
    assert {n for n in names if n.endswith("indexer.wk.weight")} <= moved
    assert "mtp.0.eh_proj.weight" in moved
