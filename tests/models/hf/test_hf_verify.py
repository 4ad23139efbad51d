"""`glmtune inspect DIR --verify` of an `hf` family directory: checkpoint/hf_verify.py, which knows no
family, checks the tiny transformers checkpoints through the hf spec's `hf_format` (transformers' model
on meta, the hf state-dict adapter's names) from the safetensors headers alone: a clean directory
passes (a MoE model's experts per expert: tests/models/hf/test_hf_moe.py), a tied head is not expected,
a damaged one is named tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from glmtune.checkpoint.hf_verify import verify_checkpoint
from glmtune.cli import main
from glmtune.models.hf.spec import HF
from tests.models.hf.conftest import CONFIGS


def _messages(report) -> list[str]:
    return [str(p) for p in report.problems]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_clean_directory_passes_by_its_headers(tiny_dir):
    report = verify_checkpoint(tiny_dir, HF.hf_format)
    assert report.ok, _messages(report)
    tensors = load_file(tiny_dir / "model.safetensors")
    assert report.num_tensors == report.num_expected == len(tensors)
    assert report.num_params == sum(t.numel() for t in tensors.values())


def test_a_tied_head_is_not_expected(tmp_path):
    directory = tmp_path / "tied"
    config = CONFIGS["llama"]()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    assert "lm_head.weight" not in load_file(directory / "model.safetensors")
    report = verify_checkpoint(directory, HF.hf_format)
    assert report.ok, _messages(report)


def test_damage_is_named_tensor_by_tensor(qwen3_dir, tmp_path):
    bad = _copy(qwen3_dir, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.mlp.gate_proj.weightX"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:8]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    found = _messages(verify_checkpoint(bad, HF.hf_format))
    assert "model.safetensors: model.layers.0.mlp.gate_proj.weight: missing" in found
    assert any(m.startswith("model.safetensors: model.layers.0.mlp.gate_proj.weightX: unexpected") for m in found)
    assert "model.safetensors: model.layers.1.self_attn.q_proj.weight: shape (8, 64), expected (64, 64)" in found


def test_a_config_of_more_layers_than_the_files_hold_is_said_before_building(qwen3_dir, tmp_path):
    bad = _copy(qwen3_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config.pop("layer_types", None)
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))
    found = _messages(verify_checkpoint(bad, HF.hf_format))
    assert len(found) == 1 and "fewer than config.json's 100,000 layers: not this config's weights" in found[0]


def test_inspect_verify_of_an_hf_directory(qwen3_dir, capsys):
    assert main(["inspect", str(qwen3_dir), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{qwen3_dir}: OK; 1 file(s)" in out
    assert main(["inspect", str(qwen3_dir), "--verify", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["verify"]["ok"] and payload["verify"]["num_expected"] == payload["verify"]["num_tensors"] > 0
