"""FSDP2 on 2 gloo ranks trains an hf family model as one process does: each rank runs one packed
row, the loss sums divided by the step's supervised tokens (the trainer's arithmetic), and the
summed loss and every full gradient equal one process's over both rows; the model loaded whole or
built on meta and filled by `HF.weights.load_sharded`; `HF.weights.save_pretrained` of the sharded model writes
the weights it loaded, for transformers to load back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from glmtune.config.schema import ParallelConfig
from glmtune.distributed.mesh import ParallelMesh
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.hf.spec import HF
from tests.distributed.gloo_helpers import run_gloo
from tests.models.hf.conftest import packed_batch, write_checkpoint

LENGTHS = [20, 12]  # two documents per row


def _row(rank: int) -> dict[str, torch.Tensor]:
    return packed_batch(LENGTHS, seed=rank)


def _supervised(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["targets"] != -100).sum())


def _rank_step(rank: int, world_size: int, directory: str, out: str, sharded_load: bool) -> None:
    """One step on this rank's row: the model loaded whole then sharded, or (`sharded_load`) built on
    meta, sharded and filled by `HF.weights.load_sharded` (what a multi-rank `glmtune train` does)."""
    if sharded_load:
        model = HF.weights.build(HF.architecture.args_from_hf(directory), torch.float32, "meta")
    else:
        model = HF.weights.load_pretrained(directory, torch.float32, "cpu")
    mesh = ParallelMesh.from_config(ParallelConfig(), world_size=world_size, rank=rank)
    HF.compute.parallelize(model, mesh, ParallelConfig())
    if sharded_load:
        assert HF.weights.load_sharded(model, directory, "cpu").tensors == len(model.state_dict())
    total = sum(_supervised(_row(r)) for r in range(world_size))
    loss_sum, _ = HF.compute.loss(model, MicroBatch(**_row(rank)))
    (loss_sum / total).backward()
    summed = loss_sum.detach().clone()
    dist.all_reduce(summed)
    grads = {name: p.grad.full_tensor().contiguous() for name, p in model.named_parameters()}
    if rank == 0:
        save_file({"loss_sum": summed, **{f"grad.{name}": g for name, g in grads.items()}}, out)
    HF.weights.save_pretrained(model, Path(out).parent / "export")  # every rank: the shards gathered, rank 0 writes


@pytest.mark.parametrize(("arch", "sharded_load"), [("qwen3", False), ("qwen3_moe", False), ("qwen3", True),
                                                    ("llama", True)])
def test_fsdp2_on_two_ranks_equals_one_process(tmp_path, arch, sharded_load):
    directory = tmp_path / arch
    write_checkpoint(arch, directory)
    out = tmp_path / "rank0.safetensors"
    run_gloo(_rank_step, 2, tmp_path, str(directory), str(out), sharded_load)
    sharded = load_file(out)

    model = HF.weights.load_pretrained(directory, torch.float32, "cpu")
    rows = [_row(0), _row(1)]
    both = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    loss_sum, _ = HF.compute.loss(model, MicroBatch(**both))
    (loss_sum / sum(_supervised(row) for row in rows)).backward()

    torch.testing.assert_close(sharded["loss_sum"], loss_sum.detach(), rtol=1e-6, atol=1e-5)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert {name.removeprefix("grad.") for name in sharded if name != "loss_sum"} == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(sharded[f"grad.{name}"], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in grads.values()) > 0
    exported = HF.weights.load_pretrained(tmp_path / "export", torch.float32, "cpu")  # no step taken: the same weights
    assert type(exported) is type(model)
    for (name, weight), (_, source) in zip(exported.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(weight, source), name
