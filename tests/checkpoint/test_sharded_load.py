"""`load_sharded`: a meta-built, parallelized model loaded rank by rank from HF safetensors.

On 2 and 4 gloo processes (FSDP 2; dp_shard 4 x ep 2, whose experts are `_StridedShard`
under FSDP2; ep 4) every parameter's `full_tensor()` equals, bit for bit, the
single-process `load_pretrained` model, and so does the forward loss; each rank reads
about its share of the checkpoint's bytes; FP8 weights are dequantized from the blocks
that cover the slice only (same bits); a missing shard file or tensor is a one-line
ValueError on every rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from glmtune import load_pretrained, save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.checkpoint.sharded_load import local_indices
from glmtune.config.schema import ParallelConfig
from glmtune.distributed.mesh import ParallelMesh
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.parallelize import parallelize_glm5
from glmtune.models.glm5.spec import GLM5
from tests.checkpoint.test_hf_io import _quantize_blockwise
from tests.distributed.gloo_helpers import run_gloo


def _parallel_model(path: Path, world_size: int, ep: int):
    args = Glm5Args.from_hf_config(path)
    model = build_model(args, torch.float32, device="meta")
    mesh = ParallelMesh.from_config(ParallelConfig(ep=ep), world_size=world_size, num_experts=args.n_routed_experts)
    parallelize_glm5(model, mesh=mesh)
    return model


def _loss(model, args):
    ids = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    return model(ids, MicroBatch(ids, targets=torch.roll(ids, -1, dims=1)), compute_logits=False).loss_sum


def _load_and_compare(rank: int, world_size: int, path: str, ep: int, out: str) -> None:
    path = Path(path)
    model = _parallel_model(path, world_size, ep)
    stats = GLM5.weights.load_sharded(model, path, None)
    reference = load_pretrained(path, dtype=torch.float32, device="cpu")
    expected = reference.state_dict()
    strided = []
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        if any(type(p).__name__ == "_StridedShard" for p in param.placements):
            strided.append(name)
        full = param.full_tensor()  # collective: the same order on every rank
        assert torch.equal(full, expected[name]), name
        # The indices the loader computed are where the local shard sits in the full tensor.
        index = local_indices(param)
        assert torch.equal(param.to_local(), full[torch.meshgrid(*index, indexing="ij")]), name
    for name, buffer in model.named_buffers():
        if not name.endswith("tokens_per_expert"):
            assert torch.equal(buffer, reference.get_buffer(name)), name
    loss = _loss(model, model.args)
    torch.testing.assert_close(loss, _loss(reference, model.args), rtol=1e-6, atol=0)
    record = {"bytes_read": stats.bytes_read, "checkpoint_bytes": stats.checkpoint_bytes,
              "local_param_bytes": stats.local_param_bytes, "peak_rss": stats.peak_rss_bytes,
              "rss_growth": stats.peak_rss_bytes - stats.start_rss_bytes, "log": stats.describe(),
              "strided": strided, "seconds": stats.seconds}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def _buffer_bytes(path: Path) -> int:
    """Bytes of the checkpoint's tensors every rank reads whole (replicated buffers)."""
    total = 0
    for file in path.glob("*.safetensors"):
        total += sum(t.numel() * t.element_size() for k, t in load_file(file).items()
                     if k.endswith("e_score_correction_bias"))
    return total


@pytest.mark.parametrize("world_size,ep", [(2, 1), (4, 2), (4, 4)], ids=["fsdp2", "ep2xfsdp2", "ep4"])
def test_sharded_load_equals_load_pretrained(saved, tmp_path, world_size, ep):
    run_gloo(_load_and_compare, world_size, tmp_path, str(saved), ep, str(tmp_path))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    total = records[0]["checkpoint_bytes"]
    replicated = _buffer_bytes(saved)
    for record in records:
        # Every parameter is split over all ranks here (dense over dp_shard, experts over
        # ep x efsdp): each rank reads its share and the replicated buffers, nothing more.
        assert record["bytes_read"] <= total / world_size + replicated, record
        assert record["bytes_read"] >= total / world_size * 0.95, record
    assert sum(r["bytes_read"] for r in records) >= total  # every byte was read by some rank
    if ep == 2:  # FSDP2 over ep-sharded experts: the composed placement the loader must follow
        assert any("experts" in name for name in records[0]["strided"]), records[0]["strided"]


def _fp8_checkpoint(path: Path) -> Path:
    """The tiny model, widened so weights span several 128x128 blocks (a partial one too),
    with every projection block-quantized to FP8 as DeepSeek/GLM releases store them."""
    args = get_preset("tiny").replace(hidden_size=256, q_lora_rank=192)
    save_pretrained(build_model(args, seed=1), path)
    tensors = load_file(path / "model.safetensors")
    for key in list(tensors):
        w = tensors[key]
        if w.dim() == 2 and key.endswith("proj.weight") and "weights_proj" not in key:
            tensors[key], tensors[key + "_scale_inv"], _ = _quantize_blockwise(w)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_fp8_checkpoint_sharded_equals_load_pretrained(tmp_path):
    # dp_shard 4: 256-row weights split in 64-row slices, which start inside a 128x128 block.
    path = _fp8_checkpoint(tmp_path / "fp8")
    run_gloo(_load_and_compare, 4, tmp_path, str(path), 2, str(tmp_path))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["bytes_read"] < 0.3 * r["checkpoint_bytes"] for r in records), records


def _strided_layouts(rank: int, world_size: int, out: str) -> None:
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from glmtune.checkpoint.sharded_load import LoadStats, load_tensor
    from glmtune.models.glm5.state_dict_adapter import Target, dequantize_fp8_block

    mesh = init_device_mesh("cpu", (2, 2))
    file = Path(out) / "layouts.safetensors"
    full = torch.randn(320, 200, generator=torch.Generator().manual_seed(0))
    q, scale, _ = _quantize_blockwise(full)  # blocks of 128: 3 x 2, partial ones at the ends
    if rank == 0:
        save_file({"w": full, "q": q, "q_scale_inv": scale}, file)
    dist.barrier()
    files = {key: file for key in ("w", "q", "q_scale_inv")}
    handle = safe_open(str(file), framework="pt", device="cpu")
    layouts = [[Shard(0), _StridedShard(0, split_factor=2)],  # e.g. rows 0-39 and 80-119: not one run
               [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP2 over a Shard(0) axis
               [Shard(1), Shard(0)], [Shard(0), Shard(0)]]
    for placements in layouts:
        for key, source in (("w", full), ("q", dequantize_fp8_block(q, scale, torch.float32))):
            expected = distribute_tensor(source, mesh, placements)
            dest = DTensor.from_local(torch.zeros_like(expected.to_local()), mesh, placements, run_check=False,
                                      shape=source.shape, stride=source.stride())
            index = local_indices(dest)
            if placements[1] == _StridedShard(0, split_factor=2) and placements[0] == Shard(0):
                assert int(index[0][-1]) - int(index[0][0]) + 1 > len(index[0]), index[0]  # not one run
            stats = LoadStats()
            load_tensor(handle, file, files, key, Target(key), dest, index, stats)
            assert torch.equal(dest.to_local(), expected.to_local()), (key, placements)
            assert stats.bytes_read < source.numel() * q.element_size() * (1 if key == "q" else 4), stats


def test_any_composition_of_shards_reads_its_own_elements(tmp_path):
    run_gloo(_strided_layouts, 4, tmp_path, str(tmp_path))


def _expect_errors(rank: int, world_size: int, cases: list[tuple[str, str]], out: str) -> None:
    for case, (path, pattern) in enumerate(cases):
        model = _parallel_model(Path(path), world_size, ep=2)
        with pytest.raises(ValueError, match=pattern) as caught:
            GLM5.weights.load_sharded(model, path, None)
        assert "\n" not in str(caught.value)
        (Path(out) / f"case{case}-rank{rank}.txt").write_text(str(caught.value))
        dist.barrier()  # every rank got the error: none is left behind in a collective


def test_missing_shard_file_or_tensor_is_one_line_error_on_every_rank(saved, tmp_path):
    key = "model.layers.3.mlp.experts.7.down_proj.weight"  # expert 7: held by ep rank 1 only
    missing_file = Path(shutil.copytree(saved, tmp_path / "no-file"))
    index = json.loads((missing_file / INDEX_NAME).read_text())["weight_map"]
    (missing_file / index[key]).unlink()
    missing_tensor = Path(shutil.copytree(saved, tmp_path / "no-tensor"))
    file = missing_tensor / index[key]
    save_file({k: v for k, v in load_file(file).items() if k != key}, file, metadata={"format": "pt"})
    # The index still names the tensor: every rank (not only the one holding expert 7) reports it.
    cases = [(str(missing_file), rf"{index[key]}: shard named in {INDEX_NAME} is missing"),
             (str(missing_tensor), rf"{index[key]}: {key}: listed in {INDEX_NAME} but not in the file")]
    run_gloo(_expect_errors, 2, tmp_path, cases, str(tmp_path))
    for case in range(2):
        assert all((tmp_path / f"case{case}-rank{r}.txt").exists() for r in range(2))
