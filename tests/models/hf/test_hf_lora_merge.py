"""`glmtune merge` of an hf-family adapter against PEFT's `merge_and_unload` on transformers' model:
the merged checkpoint (written shard by shard through the family's HF format, peft/merge_stream.py)
loads in transformers with PEFT's merged weights and glmtune's adapted model's logits.

A MoE checkpoint's experts are merged per expert, under the per-expert names transformers stores
them by (the family's state-dict adapter). `--fp8` is refused (the family has no FP8 base). Tolerances: both add s * B @ A in fp32 to fp32 weights (glmtune: `bmm`/`@`, PEFT: `einsum`), so the
weights agree to fp32 rounding (atol 1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmtune.cli import main
from glmtune.models.registry import hf_dir_identity
from glmtune.peft import export_adapter

from .conftest import packed_batch
from .test_hf_lora import adapted, reference

peft = pytest.importorskip("peft")


def exported(tiny_dir, directory):
    """glmtune's adapted model of `tiny_dir` and its adapter exported as a run exports it."""
    model = adapted(tiny_dir, seed=2).eval()
    return model, export_adapter(model, directory, base_model_name_or_path=str(tiny_dir),
                                 base_identity=hf_dir_identity(tiny_dir))


def test_merge_equals_peft_merge_and_unload(tiny_dir, tmp_path, capsys):
    model, adapter = exported(tiny_dir, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert main(["merge", str(tiny_dir), str(adapter), str(out)]) == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    expected = peft.PeftModel.from_pretrained(reference(tiny_dir), adapter).merge_and_unload()
    ours, theirs = merged.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=0, atol=1e-6, msg=key)
    base = reference(tiny_dir).state_dict()
    assert all(not torch.equal(ours[key], base[key]) for key in ours if key.endswith(("q_proj.weight", "experts.down_proj")))
    ids = packed_batch([13], seed=5)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        json.loads((tiny_dir / "config.json").read_text())["architectures"]


def test_merge_refuses_fp8_for_the_family(qwen3_dir, tmp_path, capsys):
    _, adapter = exported(qwen3_dir, tmp_path / "adapter")
    assert main(["merge", str(qwen3_dir), str(adapter), str(tmp_path / "merged"), "--fp8"]) == 2
    assert "the hf family does not do an FP8 base yet" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()
