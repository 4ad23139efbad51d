"""Check 8 on copies of the reference runs with one exported tensor changed: the HF export of the
full fine-tune, and the PEFT adapter of the LoRA run."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
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


def _noisy(reference, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    return reference + scale * reference.std() * torch.randn(reference.shape, generator=generator)


def test_bf16_bound_is_transformers_own_rounding():
    """bf16 (GPU) criterion: glmtune's error against the float32 reference is judged by transformers'
    own bf16 error; a float32 difference is a fault whatever the bf16 figures say."""
    from glmtune.preflight.export import BF16_ERROR_RATIO, FP32_REL_BOUND, bf16_logit_problems

    reference = torch.randn(1, 64, 500, generator=torch.Generator().manual_seed(0))
    reference[0, torch.arange(64), torch.arange(64) * 7] += 6.0  # a clear top-1, as a trained model's
    served = {"fp32": reference, "bf16": _noisy(reference, 0.02, 1)}
    rounding_like_theirs = {"fp32": _noisy(reference, 1e-6, 2), "bf16": _noisy(reference, 0.03, 3)}
    problems, stats = bf16_logit_problems(rounding_like_theirs, served)
    assert problems == [], problems
    assert stats["glmtune_bf16_vs_fp32"]["relative_error"] == pytest.approx(0.03, rel=0.1)
    assert stats["transformers_bf16_vs_fp32"]["relative_error"] == pytest.approx(0.02, rel=0.1)

    worse = {"fp32": rounding_like_theirs["fp32"], "bf16": _noisy(reference, 0.02 * BF16_ERROR_RATIO * 1.5, 4)}
    problems, _ = bf16_logit_problems(worse, served)
    assert len(problems) >= 1 and problems[0].startswith("bfloat16 logits are further from the float32 reference")

    wrong_math = {"fp32": _noisy(reference, 10 * FP32_REL_BOUND, 5), "bf16": rounding_like_theirs["bf16"]}
    problems, _ = bf16_logit_problems(wrong_math, served)
    assert len(problems) == 1 and problems[0].startswith("float32 logits differ from transformers'")


def test_bf16_check_loads_transformers_float32_reference_afresh(fresh, monkeypatch):
    """The float32 reference is transformers' model loaded in float32 from the export, not its bf16 model
    upcast in place (on a CUDA GPU, transformers 5.17's upcast model was 1.4e-2 from its own float32 load:
    docs/preflight.md); a bf16 run passes check 8 with it."""
    from transformers import AutoModelForCausalLM

    from glmtune.preflight.runs import run_reference

    pf = fresh(LORA.parent / "sft_support_json.yaml", "--model.dtype", "bfloat16")
    ref = run_reference(pf)
    loaded = []
    original = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        model = original(*args, **kwargs)
        loaded.append(kwargs["dtype"])
        model.float = lambda: pytest.fail("transformers' model upcast in place")  # the reference is loaded afresh
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    result = check_export(pf, ref)
    assert loaded == [torch.bfloat16, torch.float32]
    assert result.status == "pass", result.message
    assert result.evidence["logits"]["glmtune_vs_transformers_fp32"]["relative_error"] <= 1e-4
