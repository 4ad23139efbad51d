"""Check 4: a LoRA target frozen by mistake, a target that matches nothing, a full fine-tune with a frozen group."""

from __future__ import annotations

from glmtune.peft import build_inventory
from glmtune.preflight.trainable import check_trainable, transformed_meta_model
from tests.preflight.conftest import LORA, SFT


def test_lora_target_frozen_by_mistake_fails(fresh):
    pf = fresh(LORA)
    model, _ = transformed_meta_model(pf.cfg)
    for name, param in model.named_parameters():
        if ".mlp.experts.lora_" in name:  # the routed experts' adapters, frozen after apply_lora
            param.requires_grad_(False)
    result = check_trainable(pf, model, build_inventory(model))
    assert result.status == "fail"
    assert result.message.startswith("peft.target_modules '*.mlp.experts' selects 2 modules but none of their "
                                     "adapter parameters trains")
    assert any(p.startswith("group routed_experts has LoRA targets") for p in result.evidence["problems"])


def test_target_that_matches_nothing_fails(fresh):
    result = check_trainable(fresh(LORA, "--peft.target_modules", '["*.self_attn.q_proj"]'))
    assert result.status == "fail" and "'*.self_attn.q_proj' matches no module" in result.message


def test_full_fine_tuning_with_a_frozen_group_fails(fresh):
    pf = fresh(SFT)
    model, _ = transformed_meta_model(pf.cfg)
    for name, param in model.named_parameters():
        if ".self_attn." in name and ".indexer." not in name:
            param.requires_grad_(False)
    result = check_trainable(pf, model, build_inventory(model))
    assert result.status == "fail" and result.message.startswith("full fine-tuning leaves group attention frozen")
