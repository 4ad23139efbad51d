"""Exported adapters against the real consumers: `peft.PeftModel.from_pretrained` on
transformers' GlmMoeDsaForCausalLM must load them with no missing or unexpected keys and
give glmtune's logits (fp32, tiny model, random non-zero adapters)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

from glmtune.peft import apply_lora, export_adapter  # noqa: E402
from tests.parity.hf_reference import make_hf_model  # noqa: E402
from tests.peft.conftest import lora_cfg, randomize_adapters, tokens  # noqa: E402

PREFIX = "base_model.model."


def _load_with_peft(adapter_dir):
    hf = make_hf_model("glm5")  # a fresh base: PeftModel injects into it in place
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf, adapter_dir)
    problems = [str(w.message) for w in caught if "missing" in str(w.message).lower()
                or "unexpected" in str(w.message).lower()]
    return model.eval(), problems


@pytest.mark.parametrize("changes", [
    dict(),  # NVIDIA's GLM-5 target set: MLA, dense MLP, shared and routed experts
    dict(rslora=True, alpha=6.0, dropout=0.1, exclude_modules=["model.layers.2.mlp.experts.down_proj",
                                                                "model.layers.3.self_attn.o_proj"]),
])
def test_peft_loads_adapter_with_our_logits(ours, hf_dir, tmp_path, changes):
    apply_lora(ours, lora_cfg(**changes))
    randomize_adapters(ours)
    out = export_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0  # PEFT's ParamWrapper refuses dropout; inference needs none

    peft_model, problems = _load_with_peft(out)
    assert problems == []
    saved = load_file(out / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(peft_model)
    assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))[:6]  # no missing, no unexpected keys
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key

    x = tokens()
    ours.eval()
    with torch.no_grad():
        expected, actual = peft_model(x).logits, ours(x).logits
    base = make_hf_model("glm5").eval()
    with torch.no_grad():
        assert (base(x).logits - actual).abs().max() > 1e-2  # the adapter matters
    assert (expected - actual).abs().max().item() <= 1e-4


def test_peft_layout_keys_and_shapes(ours, tmp_path):
    apply_lora(ours, lora_cfg(target_modules=["*.mlp.experts", "*.shared_experts.up_proj", "*.q_a_proj"]))
    saved = load_file(export_adapter(ours, tmp_path / "a") / "adapter_model.safetensors")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["self_attn.q_a_proj"]
    # gate/up/down_proj Linears go to target_parameters: PEFT rewrites such target_modules
    # entries into the fused expert parameters for glm_moe_dsa and would drop them.
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                           "mlp.shared_experts.up_proj.weight"]
    E, r, D, I = 8, 4, 64, 32
    layer = PREFIX + "model.layers.1.mlp.experts"
    assert saved[f"{layer}.base_layer.lora_A.weight"].shape == (E * r, D)   # gate_up_proj, inner wrapper
    assert saved[f"{layer}.base_layer.lora_B.weight"].shape == (2 * I, r * E)
    assert saved[f"{layer}.lora_A.weight"].shape == (E * r, I)              # down_proj, outer wrapper
    assert saved[f"{layer}.lora_B.weight"].shape == (D, r * E)
    experts = ours.get_submodule("model.layers.1.mlp.experts")
    b = experts.lora_gate_up_B  # [E, 2I, r] -> PEFT's rank-major columns: [:, k*E + e]
    assert torch.equal(saved[f"{layer}.base_layer.lora_B.weight"][:, 1 * E + 3], b[3, :, 1])
    peft_model, _ = _load_with_peft(tmp_path / "a")
    wrapper = peft_model.base_model.model.model.layers[1].mlp.experts
    assert wrapper.parameter_name == "down_proj" and wrapper.base_layer.parameter_name == "gate_up_proj"


def test_per_expert_layout_for_engines(ours, tmp_path):
    apply_lora(ours, lora_cfg(target_modules=["*.q_a_proj", "*.mlp.experts"]))
    randomize_adapters(ours)
    out = export_adapter(ours, tmp_path / "engines", layout="per_expert")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "q_a_proj", "up_proj"]
    assert "target_parameters" not in config
    saved = load_file(out / "adapter_model.safetensors")
    experts = ours.get_submodule("model.layers.2.mlp.experts")
    key = PREFIX + "model.layers.2.mlp.experts.5.{}.lora_{}.weight"
    assert torch.equal(saved[key.format("gate_proj", "A")], experts.lora_gate_up_A[5])
    assert torch.equal(saved[key.format("up_proj", "A")], experts.lora_gate_up_A[5])  # the shared A, twice
    assert torch.equal(saved[key.format("gate_proj", "B")], experts.lora_gate_up_B[5, :32])
    assert torch.equal(saved[key.format("up_proj", "B")], experts.lora_gate_up_B[5, 32:])
    assert saved[key.format("down_proj", "A")].shape == (4, 32) and saved[key.format("down_proj", "B")].shape == (64, 4)
    assert len(saved) == 2 * 4 + 2 * 3 * 8 * 3  # A+B: q_a_proj x4 layers, 3 MoE layers x 8 experts x 3 projs
    # PEFT's own transformers-v4 conversion reads per-expert keys too (when no dense or shared
    # gate/up/down_proj is targeted): an independent check that the layout means the same adapter.
    # PEFT matches the bare names everywhere, so it also adapts the dense and shared MLPs' projections,
    # which this adapter leaves alone: they keep PEFT's initialisation, B = 0, no change to the output
    # (PEFT 0.22 warns that their keys are missing; 0.21 did not).
    peft_model, _ = _load_with_peft(out)
    loaded = get_peft_model_state_dict(peft_model)  # the routed experts' in PEFT's own fused form
    dense_or_shared = re.compile(PREFIX + r"model\.layers\.\d+\.mlp\.(shared_experts\.)?"
                                 r"(gate|up|down)_proj\.lora_[AB]\.weight")
    untouched = {k for k in loaded if dense_or_shared.fullmatch(k)}
    assert not untouched & set(saved)
    assert all(loaded[k].count_nonzero() == 0 for k in untouched if ".lora_B." in k)
    x = tokens(seed=4)
    with torch.no_grad():
        assert (peft_model(x).logits - ours.eval()(x).logits).abs().max().item() <= 1e-4


def test_export_refuses_what_an_adapter_cannot_carry(ours, tmp_path):
    apply_lora(ours, lora_cfg())
    ours.model.layers[0].input_layernorm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="model.layers.0.input_layernorm.weight is trainable but a LoRA"):
        export_adapter(ours, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_adapter(_meta_tiny(), tmp_path / "y")
    with pytest.raises(ValueError, match="layout 'vllm' unknown"):
        export_adapter(ours, tmp_path / "z", layout="vllm")


def _meta_tiny():
    from glmtune.models.glm5 import build_model, get_preset
    return build_model(get_preset("tiny"), device="meta")
