"""A checkpoint of an expert-parallel, FSDP-sharded run loads into one process with every
parameter and every AdamW moment exactly as the sharded run held them (DCP reshards)."""

from __future__ import annotations

from pathlib import Path

import torch

from glmtune.checkpoint.manager import CheckpointManager
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.gloo_helpers import run_gloo


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(10 + rank))


def _train_one_step_and_save(rank: int, world_size: int, root: str) -> None:
    from glmtune.config.schema import ParallelConfig
    from glmtune.distributed.mesh import ParallelMesh
    from glmtune.models.glm5.parallelize import parallelize_glm5

    model = build_model(get_preset("tiny"), torch.float32, "cpu", "eager", seed=0)
    mesh = ParallelMesh.from_config(ParallelConfig(ep=2), world_size=world_size)
    parallelize_glm5(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _tokens(rank)
    out = model(ids, MicroBatch(ids, targets=torch.roll(ids, -1, dims=1)), compute_logits=False)
    out.loss_sum.backward()
    optimizer.step()
    CheckpointManager(Path(root) / "ckpt", keep_last=0).save(1, model, optimizer, {"note": "sharded"})
    # What the sharded run holds, gathered: the reference for the one-process load.
    full = {}
    for name, param in model.named_parameters():
        state = optimizer.state[param]  # empty for parameters that got no gradient (MTP, frozen indexer)
        values = [("param", param)] + [(key, state[key]) for key in ("exp_avg", "exp_avg_sq") if key in state]
        for key, value in values:
            full[f"{name}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach()
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, Path(root) / "expected.pt")


def test_ep2_fsdp2_checkpoint_loads_into_one_process_exactly(tmp_path):
    run_gloo(_train_one_step_and_save, 4, tmp_path, str(tmp_path), timeout_s=240)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    model = build_model(get_preset("tiny"), torch.float32, "cpu", "eager", seed=1)  # other values on purpose
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(tmp_path / "ckpt")
    state = manager.load(manager.latest(), model, optimizer)
    assert state["note"] == "sharded"
    moments = 0
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[f"{name}/param"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            if f"{name}/{key}" in expected:
                assert torch.equal(optimizer.state[param][key], expected[f"{name}/{key}"]), (name, key)
                moments += 1
    assert any(".experts." in key and "exp_avg" in key for key in expected)  # expert moments, resharded
    assert moments == sum("/exp_avg" in key for key in expected) > 100
