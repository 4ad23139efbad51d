"""The hf family's LoRA hooks (`HF.lora`): peft/ finds an hf model's family, so a full fine-tuning
run's inventory of what trains (peft/inventory.py, by the spec's parameter groups) covers it; the
default targets, what is refused and why (experts PEFT would not load the same way, dropout on
experts whose adapters fold into their weights), and LoRA recipes valid for the family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig

from glmtune.config import load_config, validate_config
from glmtune.config.schema import PeftConfig
from glmtune.models import catalog
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.hf.spec import HF
from glmtune.peft import apply_lora
from glmtune.peft.family import spec_of
from glmtune.peft.inventory import build_inventory


def test_peft_finds_the_family_and_inventories_every_parameter(tiny_dir):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    assert spec_of(model) is HF
    inventory = build_inventory(model).to_dict()
    total = sum(p.numel() for p in model.parameters())
    assert inventory["method"] == "full" and inventory["trainable"] == inventory["total"] == total
    assert sum(group["trainable"] for group in inventory["groups"].values()) == total
    assert all(inventory["groups"][group]["trainable"] > 0 for group in ("embeddings", "attention", "norm", "head"))
    assert not HF.lora.owns(build_model(get_preset("tiny"), torch.float32, device="meta"))


def test_the_default_targets_are_the_same_on_an_adapted_model(tiny_dir):
    """What preflight reads off a model `apply_lora` transformed: the plain model's defaults."""
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    plain = HF.lora.default_targets(model)
    apply_lora(model, PeftConfig(method="lora", rank=2), seed=0)
    assert HF.lora.default_targets(model) == plain


def test_experts_peft_would_not_load_the_same_way_are_refused_by_name():
    """GPT-OSS keeps its experts transposed, with biases: no expert adapter, one sentence saying why;
    the defaults leave them out (its attention still takes LoRA)."""
    config = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"^peft.target_modules: '\*.mlp.experts' matches no module; it matches "
                                         r"only model.layers.0.mlp.experts, which cannot take LoRA: its stacked "
                                         r"experts \(GptOssExperts: .*\) are not in the layout"):
        apply_lora(model, PeftConfig(method="lora", target_modules=["*.mlp.experts"]))
    inventory = apply_lora(model, PeftConfig(method="lora"))
    assert inventory.target_modules == ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj",
                                        "*.self_attn.o_proj"]


def test_dropout_cannot_apply_to_folded_experts(tiny_dir):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    cfg = PeftConfig(method="lora", dropout=0.1)
    if not any(HF.lora.is_grouped_experts(module) for module in model.modules()):  # dropout on every adapter input
        apply_lora(model, cfg)
        return
    with pytest.raises(ValueError, match=r"^peft.dropout: 0.1 cannot apply to model.layers.0.mlp.experts: this "
                                         r"family's stacked experts take LoRA as an update of their weights"):
        apply_lora(model, cfg)
    apply_lora(model, PeftConfig(method="lora", dropout=0.1, exclude_modules=["*.mlp.experts"]))


def test_lora_recipes_validate_for_the_family(qwen3_dir):
    """peft.method: lora was refused at config time before the family's LoRA rules existed."""
    cfg = load_config("recipes/tiny/lora_support_json.yaml", [f"--model.name_or_path={qwen3_dir}"])
    dims = catalog.model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, model_refusals=dims.refusals)
