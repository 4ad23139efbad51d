"""The hf family's LoRA hooks (`HF.lora`): peft/ finds an hf model's family, so a full fine-tuning
run's inventory of what trains (peft/inventory.py, by the spec's parameter groups) covers it."""

from __future__ import annotations

import torch

from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.hf.spec import HF
from glmtune.peft.family import spec_of
from glmtune.peft.inventory import build_inventory


def test_peft_finds_the_family_and_inventories_every_parameter(tiny_dir):
    model = HF.load_pretrained(tiny_dir, torch.float32, "cpu")
    assert spec_of(model) is HF
    inventory = build_inventory(model).to_dict()
    total = sum(p.numel() for p in model.parameters())
    assert inventory["method"] == "full" and inventory["trainable"] == inventory["total"] == total
    assert sum(group["trainable"] for group in inventory["groups"].values()) == total
    assert all(inventory["groups"][group]["trainable"] > 0 for group in ("embeddings", "attention", "norm", "head"))
    assert not HF.lora.owns(build_model(get_preset("tiny"), torch.float32, device="meta"))
