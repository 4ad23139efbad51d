"""Merging: `glmtune merge BASE ADAPTER OUT` gives the adapted model's logits, in glmtune and
in transformers; both export layouts merge to the same weights; in-memory merge_lora too."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from glmtune import load_pretrained
from glmtune.cli import main
from glmtune.peft import apply_lora, export_adapter, lora_modules, merge_adapter_dir, merge_lora
from tests.peft.conftest import lora_cfg, randomize_adapters, tokens


def _load(path):
    return load_pretrained(path, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm").eval()


def test_merge_command_matches_unmerged_adapter(ours, hf_dir, tmp_path):
    apply_lora(ours, lora_cfg(rslora=True))
    randomize_adapters(ours)
    adapter = export_adapter(ours, tmp_path / "adapter")
    x = tokens(seed=2)
    with torch.no_grad():
        unmerged = ours.eval()(x).logits
    assert main(["merge", str(hf_dir), str(adapter), str(tmp_path / "merged")]) == 0
    merged = _load(tmp_path / "merged")
    with torch.no_grad():
        assert (merged(x).logits - unmerged).abs().max().item() <= 1e-5
        assert (_load(hf_dir)(x).logits - unmerged).abs().max().item() > 1e-2  # the merge did something
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        assert (hf(x).logits - unmerged).abs().max().item() <= 1e-4  # our HF-parity tolerance


def test_both_layouts_merge_to_the_same_weights(ours, hf_dir, tmp_path):
    apply_lora(ours, lora_cfg(exclude_modules=["model.layers.3.mlp.experts.gate_up_proj"]))
    randomize_adapters(ours, seed=3)
    export_adapter(ours, tmp_path / "peft")
    export_adapter(ours, tmp_path / "engines", layout="per_expert")
    a, b = _load(hf_dir), _load(hf_dir)
    # MLA 4x4 (kv_b_proj only when asked), dense MLP 3, shared experts 3x3, experts: two wrappers
    # in layers 1-2, one in layer 3
    assert merge_adapter_dir(a, tmp_path / "peft") == 4 * 4 + 3 + 3 * 3 + 2 * 2 + 1
    merge_adapter_dir(b, tmp_path / "engines")
    merge_lora(ours)
    assert not lora_modules(ours)
    expected = ours.state_dict()
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-6, msg=name)
        torch.testing.assert_close(b.state_dict()[name], expected[name], rtol=0, atol=2e-6, msg=name)


def test_merge_rejects_adapters_that_do_not_fit(ours, hf_dir, tmp_path):
    apply_lora(ours, lora_cfg(target_modules=["*.o_proj"]))
    adapter = export_adapter(ours, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        merge_adapter_dir(_load(hf_dir), adapter)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    base = _load(hf_dir)
    base.model.layers[0].self_attn.o_proj = torch.nn.Linear(16, 64, bias=False)  # a different width
    with pytest.raises(ValueError, match="o_proj gives a delta of shape"):
        merge_adapter_dir(base, adapter)
    assert main(["merge", str(hf_dir), str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
