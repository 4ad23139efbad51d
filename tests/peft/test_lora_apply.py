"""apply_lora: glob matching, freezing, dtypes, user errors, and the trainable inventory."""

from __future__ import annotations

import json

import pytest
import torch

from glmtune.cli import main
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.param_groups import count_by_group
from glmtune.peft import apply_lora, build_inventory, lora_modules
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear
from tests.peft.conftest import lora_cfg


def test_default_targets_adapt_nvidia_set_and_freeze_the_rest():
    model = build_model(get_preset("tiny"), dtype=torch.bfloat16, seed=0)
    inventory = apply_lora(model, lora_cfg())
    kinds = {name.split(".", 3)[-1] for name, _ in lora_modules(model)}
    # kv_b_proj only when asked: vLLM's absorbed MLA decode would not apply its delta (schema.py)
    assert kinds == {"self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                     "mlp.shared_experts.down_proj", "mlp.experts"}
    assert not any(name.startswith("mtp.") for name, _ in lora_modules(model))
    for name, param in model.named_parameters():
        assert param.requires_grad == (".lora_" in name), name
        assert param.dtype == (torch.float32 if ".lora_" in name or name.endswith("mlp.gate.weight")
                               else torch.bfloat16), name
    trainable = inventory.trainable_by_group()
    assert trainable == count_by_group(model, trainable_only=True)
    for group in ("attention", "shared_experts", "routed_experts", "dense_mlp"):
        assert trainable[group] > 0, group
    for group in ("indexer", "router", "norms", "embeddings", "head", "mtp"):
        assert trainable[group] == 0, group
    # routed experts: [E, r, D] + [E, 2I, r] + [E, r, I] + [E, D, r] per MoE layer, stacked
    args = model.args
    per_layer = args.n_routed_experts * 4 * (2 * args.hidden_size + 3 * args.moe_intermediate_size)
    assert trainable["routed_experts"] == per_layer * args.mlp_layer_types.count("sparse")


def test_unset_targets_are_the_familys_default_and_recorded(tiny):
    """peft.target_modules null (the schema's default) means GLM-5's list, which the inventory (the
    run's trainable.json) records; an explicit empty list is refused, not taken as the default."""
    assert lora_cfg().target_modules is None
    inventory = apply_lora(tiny, lora_cfg(exclude_modules=["model.layers.3.*.down_proj"]))
    record = inventory.to_dict()
    assert record["target_modules"] == list(DEFAULT_LORA_TARGETS)
    assert record["exclude_modules"] == ["model.layers.3.*.down_proj"]
    assert "peft.target_modules: *.self_attn.q_a_proj, " in "\n".join(inventory.lines())
    with pytest.raises(ValueError, match="peft.target_modules is empty: nothing would train"):
        apply_lora(build_model(get_preset("tiny"), seed=0), lora_cfg(target_modules=[]))


def test_experts_shown_training_when_targeted_and_frozen_when_not(tiny):
    other = build_model(get_preset("tiny"), seed=0)
    targeted = apply_lora(tiny, lora_cfg())
    not_targeted = apply_lora(other, lora_cfg(target_modules=[t for t in DEFAULT_LORA_TARGETS
                                                             if t != "*.mlp.experts"]))
    row = targeted.row("routed_experts")
    assert row.trainable > 0 and row.targets == ["mlp.experts.gate_up_proj+down_proj, 8 experts (x2)"]
    row = not_targeted.row("routed_experts")
    assert row.trainable == 0 and row.targets == [] and row.frozen > 0
    text = "\n".join(not_targeted.lines())
    assert "routed_experts  trainable              0" in text and "frozen" in text


def test_expert_projections_selectable_and_excludable(tiny):
    apply_lora(tiny, lora_cfg(target_modules=["*.mlp.experts"], exclude_modules=["model.layers.3.*.down_proj"]))
    adapted = dict(lora_modules(tiny))
    assert set(adapted) == {"model.layers.2.mlp.experts", "model.layers.3.mlp.experts"}
    assert adapted["model.layers.2.mlp.experts"].targets == ("gate_up_proj", "down_proj")
    assert adapted["model.layers.3.mlp.experts"].targets == ("gate_up_proj",)
    assert isinstance(adapted["model.layers.3.mlp.experts"], LoRAGroupedExperts)


@pytest.mark.parametrize("changes, message", [
    (dict(target_modules=["*.self_attn.q_proj"]), "peft.target_modules: '*.self_attn.q_proj' matches no module"),
    (dict(target_modules=["*.mlp.gate"]), "the router stays frozen"),
    (dict(target_modules=["lm_head"]), "lm_head.weight directly"),
    (dict(target_modules=["*.indexer.wk"]), "DSA indexer"),
    (dict(exclude_modules=["*.nothing"]), "peft.exclude_modules: '*.nothing'"),
    (dict(target_modules=["*.o_proj"], exclude_modules=["*"]), "removes every module"),
    (dict(method="none"), "peft.method"),
    (dict(rank=0), "peft.rank"),
    (dict(alpha=0.0), "peft.alpha"),
    (dict(dropout=1.0), "peft.dropout"),
])
def test_user_errors_name_the_key(tiny, changes, message):
    with pytest.raises(ValueError, match=None) as info:
        apply_lora(tiny, lora_cfg(**changes))
    assert message in str(info.value)
    assert all(p.requires_grad for n, p in tiny.named_parameters() if "indexer" not in n and "mtp" not in n)


def test_apply_twice_refused_and_seed_is_deterministic(tiny):
    apply_lora(tiny, lora_cfg(), seed=7)
    with pytest.raises(ValueError, match="already carries LoRA"):
        apply_lora(tiny, lora_cfg())
    other = build_model(get_preset("tiny"), seed=0)
    state = torch.random.get_rng_state()
    apply_lora(other, lora_cfg(), seed=7)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left alone
    a = dict(tiny.named_parameters())["model.layers.0.self_attn.q_a_proj.lora_A.weight"]
    b = dict(other.named_parameters())["model.layers.0.self_attn.q_a_proj.lora_A.weight"]
    assert torch.equal(a, b)


def test_apply_on_meta_and_full_finetune_inventory():
    model = build_model(get_preset("glm5"), device="meta")
    inventory = apply_lora(model, lora_cfg(rank=32, alpha=64.0))
    assert inventory.row("routed_experts").trainable == 75 * 256 * 32 * (2 * 6144 + 3 * 2048)
    assert isinstance(dict(lora_modules(model))["model.layers.0.self_attn.q_a_proj"], LoRALinear)
    full = build_inventory(build_model(get_preset("tiny"), device="meta"))
    assert full.method == "full" and full.row("routed_experts").targets == []
    assert full.row("indexer").trainable == 0 and full.row("attention").trainable > 0


def test_inspect_trainable_prints_inventory(capsys):
    assert main(["inspect", "--trainable", "recipes/tiny/lora_support_json.yaml"]) == 0
    out = capsys.readouterr().out
    for text in ("Trainable parameters (LoRA r=8", "routed_experts", "mlp.experts.gate_up_proj+down_proj",
                 "self_attn.q_a_proj (x4)", "trainable"):
        assert text in out, text
    assert main(["inspect", "--trainable", "recipes/tiny/lora_support_json.yaml", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["trainable_params_by_group"]["routed_experts"] > 0
    assert payload["trainable_params_by_group"]["router"] == 0
    assert payload["trainable_inventory"]["method"] == "lora"


def test_inspect_trainable_rejects_model_argument(capsys):
    assert main(["inspect", "tiny", "--trainable", "recipes/tiny/lora_support_json.yaml"]) == 2
    assert "--trainable RECIPE.yaml takes the model from the recipe" in capsys.readouterr().err
