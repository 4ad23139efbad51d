"""`HF_FAMILY`, the hf family's torch-free answers: config.json's shapes and dims, the counts from
the shapes against transformers' own model, and the refusals (no presets, no overrides, what the
loss on the final hidden states does not apply)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from glmtune.models.hf.family import HF_FAMILY
from glmtune.models.hf.spec import HF


def test_dims_and_parameter_count_match_transformers(tiny_dir):
    args = HF_FAMILY.read_args(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    dims = HF_FAMILY.dims(args, "here", {})
    assert dims.num_layers == 2 and dims.num_experts == (4 if config["model_type"] == "qwen3_moe" else 0)
    model = HF.weights.build(args, device="meta")
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert HF_FAMILY.parameter_count(args) == matrices
    costs, head = HF_FAMILY.stage_costs(args, 128)
    assert len(costs) == 2 and all(cost > 0 for cost in costs) and head > 0
    assert HF.architecture.flops_per_token(args, [64, 64]) < HF.architecture.flops_per_token(args, [128])  # less attention when packed


def test_no_presets_no_overrides(tiny_dir):
    args = HF_FAMILY.read_args(tiny_dir)
    with pytest.raises(ValueError, match="unknown model preset"):
        HF_FAMILY.preset_args("tiny")
    with pytest.raises(ValueError, match="model.overrides apply to presets, and the hf family has none"):
        HF_FAMILY.dims(args, "here", {"num_hidden_layers": 1})


@pytest.mark.parametrize(("change", "message"), [
    ({"final_logit_softcapping": 30.0}, "soft-caps the logits"),
    ({"output_router_logits": True}, "router's auxiliary loss"),
    ({"architectures": ["LlamaModel"]}, "trains a causal LM"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
])
def test_refused_configs(tmp_path, change, message):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        HF_FAMILY.read_args(tmp_path)


def test_unknown_model_type_is_named(tmp_path):
    config = {"model_type": "no_such_lm", "architectures": ["NoSuchLMForCausalLM"], "vocab_size": 32,
              "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'no_such_lm': transformers .* does not implement it"):
        HF.weights.build(HF.architecture.args_from_hf(tmp_path), device="meta")


def test_family_is_torch_free(tiny_dir):
    code = ("import sys; from glmtune.models.hf.family import HF_FAMILY; "
            f"HF_FAMILY.read_args({str(tiny_dir)!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unavailable_parts_are_refused_by_name(tiny_dir):
    args = HF.architecture.args_from_hf(tiny_dir)
    model = HF.weights.build(args, device="meta")
    for call, what in [(lambda: HF.compute.pipeline_options(), "pipeline parallelism"),
                       (lambda: HF.weights.convert_to_fp8_base(model, "torch"), "FP8 base")]:
        with pytest.raises(ValueError, match=f"the hf family does not do .*{what}"):
            call()
    assert HF.compute.moe_layers(model) == []
    assert dict(HF.weights.state_dict_adapter(args).to_hf("lm_head.weight", torch.zeros(1))).keys() == {"lm_head.weight"}
