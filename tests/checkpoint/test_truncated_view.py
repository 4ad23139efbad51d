"""truncate.py: the first K layers of an HF checkpoint as a directory glmtune and transformers load."""

from __future__ import annotations

import json

import torch

from glmtune import load_pretrained
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.spec import GLM5
from glmtune.models.glm5.args import covering_layers


def test_covering_layers():
    assert covering_layers(get_preset("tiny")) == 3  # dense, dense + shared indexer, MoE
    assert covering_layers(get_preset("glm5")) == 4  # 3 dense layers, then MoE
    assert covering_layers(get_preset("glm5.2")) == 4


def test_view_reads_the_first_layers_of_the_original(ckpt, tmp_path):
    view = GLM5.weights.truncated_view(ckpt, tmp_path / "view", 2)
    config = json.loads((view / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["num_nextn_predict_layers"] == 0
    assert config["indexer_types"] == ["full", "shared"] and config["mlp_layer_types"] == ["dense", "dense"]
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4.")) for k in index)
    assert all((view / name).resolve().parent == ckpt.resolve() for name in set(index.values()))
    small, full = load_pretrained(view, torch.float32), load_pretrained(ckpt, torch.float32)
    full_state = full.state_dict()
    for key, tensor in small.state_dict().items():
        assert torch.equal(tensor, full_state[key]), key
