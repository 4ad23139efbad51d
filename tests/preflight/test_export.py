"""Check 8 on copies of the reference runs with one exported tensor changed: the HF export of the
full fine-tune, and the PEFT adapter of the LoRA run."""

from __future__ import annotations

import dataclasses
import shutil

import torch
from safetensors.torch import load_file, save_file

from glmtune.preflight.export import check_export
from tests.preflight.conftest import LORA


def _tamper(file, key):
    tensors = load_file(file)
    tensors[key] = tensors[key] + 0.05
    save_file(tensors, str(file), metadata={"format": "pt"})


def _copy(done, tmp_path):
    ref = done.reference()
    return dataclasses.replace(ref, run_dir=shutil.copytree(ref.run_dir, tmp_path / "reference", symlinks=True))


def test_tampered_hf_tensor_fails(sft_done, fresh, tmp_path):
    ref = _copy(sft_done, tmp_path)
    key = "model.layers.0.self_attn.q_a_proj.weight"
    file = next(f for f in (ref.run_dir / "hf").glob("*.safetensors") if key in load_file(f))
    _tamper(file, key)
    result = check_export(fresh(), ref)
    assert result.status == "fail"
    assert result.message.startswith(f"hf/{file.name}: {key} differs from the checkpoint's (max difference 0.05")


def test_tampered_adapter_tensor_fails(lora_done, fresh, tmp_path):
    ref = _copy(lora_done, tmp_path)
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    _tamper(ref.run_dir / "adapter" / "adapter_model.safetensors", key)
    result = check_export(fresh(LORA), ref)
    assert result.status == "fail"
    assert result.message.startswith(f"adapter/adapter_model.safetensors: {key} differs from the checkpoint's")
    assert any("logits differ by up to" in p for p in result.evidence["problems"])  # PEFT reads the change
    assert torch.isfinite(torch.tensor(result.evidence["logits"]["max_abs_difference"]))
