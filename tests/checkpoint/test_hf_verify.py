"""`verify_checkpoint`: header-only checks of HF checkpoint directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME, SINGLE_NAME, hf_tensors
from glmtune.checkpoint.hf_verify import expected_hf_shapes, verify_checkpoint
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.spec import GLM5
from tests.checkpoint_fixtures import Q_A, weight_map


def verify(path: Path):
    """`verify_checkpoint` of a GLM-5 directory (GLM-5's spec hands over its `hf_format`)."""
    return verify_checkpoint(path, GLM5.hf_format)


def rewrite_shard(ckpt: Path, key: str, edit) -> str:
    """Apply `edit(tensors)` to the shard holding `key`; returns the shard name."""
    shard = weight_map(ckpt)[key]
    tensors = load_file(ckpt / shard)
    edit(tensors)
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    return shard


def messages(report) -> list[str]:
    return [str(p) for p in report.problems]


def test_clean_sharded_checkpoint_passes(ckpt):
    report = verify(ckpt)
    assert report.ok, messages(report)
    keys = weight_map(ckpt)
    assert report.num_files == len(set(keys.values())) > 3
    assert report.num_tensors == report.num_expected == len(keys)
    # fp32 tiny model: params + MTP params + router bias buffers (16 + 8).
    assert report.num_params == 2_241_440 + 24
    assert report.num_bytes == 4 * report.num_params
    assert report.args.num_hidden_layers == 4


def test_expected_shapes_follow_the_adapter():
    shapes = expected_hf_shapes(GLM5.hf_format, get_preset("tiny"))
    assert shapes["model.layers.2.mlp.experts.7.gate_proj.weight"] == (64, 128)
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (128, 64)
    assert shapes["model.layers.4.eh_proj.weight"] == (128, 256)  # MTP layer on disk
    assert "model.layers.1.self_attn.indexer.wk.weight" not in shapes  # shared-indexer layer
    assert "lm_head.weight" not in expected_hf_shapes(GLM5.hf_format, get_preset("tiny").replace(tie_word_embeddings=True))


def test_tied_bf16_single_file_passes(tmp_path):
    args = get_preset("tiny").replace(tie_word_embeddings=True)
    save_pretrained(build_model(args, dtype=torch.bfloat16, seed=0), tmp_path / "tied")
    report = verify(tmp_path / "tied")
    assert report.ok, messages(report)
    assert report.num_files == 1


def test_deleted_shard(ckpt):
    shard = weight_map(ckpt)[Q_A]
    (ckpt / shard).unlink()
    report = verify(ckpt)
    assert any(p.file == shard and "missing" in p.message for p in report.problems)
    # Its tensors are reported once, through the shard, not one by one.
    assert not any(p.key == Q_A for p in report.problems)


def test_truncated_shard(ckpt):
    shard = weight_map(ckpt)[Q_A]
    data = (ckpt / shard).read_bytes()
    (ckpt / shard).write_bytes(data[:-7])
    report = verify(ckpt)
    assert [(p.file, p.key) for p in report.problems] == [(shard, None)]
    assert "truncated" in report.problems[0].message


def test_truncated_into_header(ckpt):
    shard = weight_map(ckpt)[Q_A]
    (ckpt / shard).write_bytes((ckpt / shard).read_bytes()[:20])
    report = verify(ckpt)
    assert any(p.file == shard and "not a safetensors file" in p.message for p in report.problems)


def test_renamed_key(ckpt):
    renamed = Q_A.replace("q_a_proj", "q_a_proj_renamed")
    shard = rewrite_shard(ckpt, Q_A, lambda t: t.__setitem__(renamed, t.pop(Q_A)))
    index = json.loads((ckpt / INDEX_NAME).read_text())
    index["weight_map"][renamed] = index["weight_map"].pop(Q_A)
    (ckpt / INDEX_NAME).write_text(json.dumps(index))
    report = verify(ckpt)
    assert {(p.file, p.key) for p in report.problems} == {(INDEX_NAME, Q_A), (shard, renamed)}
    assert "missing" in next(p.message for p in report.problems if p.key == Q_A)
    assert "unexpected" in next(p.message for p in report.problems if p.key == renamed)


def test_index_and_header_disagree(ckpt):
    renamed = Q_A + ".extra"
    shard = rewrite_shard(ckpt, Q_A, lambda t: t.__setitem__(renamed, t.pop(Q_A)))
    found = messages(verify(ckpt))
    assert f"{shard}: {Q_A}: listed in {INDEX_NAME} but not in the file" in found
    assert f"{shard}: {renamed}: in the file but not in {INDEX_NAME}" in found


def test_wrong_shape(ckpt):
    shard = rewrite_shard(ckpt, Q_A, lambda t: t.__setitem__(Q_A, t[Q_A][:63].clone()))
    found = messages(verify(ckpt))
    assert found == [f"{shard}: {Q_A}: shape (63, 128), expected (64, 128)"]


def test_all_problems_collected(ckpt):
    keys = weight_map(ckpt)
    other = "model.layers.3.self_attn.o_proj.weight"
    assert keys[other] != keys[Q_A]
    rewrite_shard(ckpt, Q_A, lambda t: t.__setitem__(Q_A, t[Q_A][:63].clone()))
    (ckpt / keys[other]).unlink()
    report = verify(ckpt)
    assert len(report.problems) == 2


def test_broken_config_still_checks_shards(ckpt):
    (ckpt / "config.json").write_text("{not json")
    shard = weight_map(ckpt)[Q_A]
    (ckpt / shard).unlink()
    report = verify(ckpt)
    assert report.args is None
    assert {p.file for p in report.problems} == {"config.json", shard}


def test_router_bias_must_be_f32(ckpt):
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    shard = rewrite_shard(ckpt, bias, lambda t: t.__setitem__(bias, t[bias].bfloat16()))
    assert messages(verify(ckpt)) == [f"{shard}: {bias}: dtype BF16, expected F32"]


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        verify(tmp_path / "nope")


def test_read_header_does_not_need_data(ckpt):
    shard = weight_map(ckpt)[Q_A]
    header, data_start = read_header(ckpt / shard)
    assert header[Q_A]["shape"] == [64, 128] and data_start > 8


# -- FP8 (block-quantized) checkpoints, written by hand -----------------------------------
FP8_KEY = "lm_head.weight"  # [4096, 128] -> 32 x 1 blocks of 128 x 128


def write_fp8_checkpoint(path: Path, scale_shape: tuple[int, ...] | None, extra: dict | None = None) -> Path:
    model = build_model(get_preset("tiny"), dtype=torch.bfloat16, seed=0)
    tensors = {key: t.detach().clone().contiguous() for key, t in hf_tensors(model.state_dict(), GLM5.weights.state_dict_adapter(model.args))}
    tensors[FP8_KEY] = tensors[FP8_KEY].to(torch.float8_e4m3fn)
    if scale_shape is not None:
        tensors[FP8_KEY + "_scale_inv"] = torch.ones(scale_shape, dtype=torch.float32)
    tensors.update(extra or {})
    path.mkdir()
    save_file(tensors, path / SINGLE_NAME, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.args.to_hf_dict()))
    return path


def test_fp8_with_correct_scale_passes(tmp_path):
    report = verify(write_fp8_checkpoint(tmp_path / "fp8", (32, 1)))
    assert report.ok, messages(report)
    assert report.num_tensors == report.num_expected + 1  # the scale


def test_fp8_with_wrong_scale_shape(tmp_path):
    report = verify(write_fp8_checkpoint(tmp_path / "fp8", (32, 2)))
    assert messages(report) == [
        f"{SINGLE_NAME}: {FP8_KEY}_scale_inv: shape (32, 2), expected (32, 1) (128x128 blocks of (4096, 128))"]


def test_fp8_without_scale(tmp_path):
    report = verify(write_fp8_checkpoint(tmp_path / "fp8", None))
    assert messages(report) == [f"{SINGLE_NAME}: {FP8_KEY}: F8_E4M3 tensor without {FP8_KEY}_scale_inv"]


def test_scale_without_fp8_weight_is_unexpected(tmp_path):
    stray = Q_A + "_scale_inv"
    report = verify(write_fp8_checkpoint(tmp_path / "fp8", (32, 1), {stray: torch.ones(1, 1)}))
    assert [(p.file, p.key) for p in report.problems] == [(SINGLE_NAME, stray)]
    assert "unexpected" in report.problems[0].message
