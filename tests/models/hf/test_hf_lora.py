"""LoRA on the hf family against PEFT 0.21 on transformers' own model, for tiny Llama, Qwen3,
Qwen3-MoE and GLM-4 checkpoints: glmtune's adapted model and PEFT's model with glmtune's export
loaded (`PeftModel.from_pretrained`) give the same logits, and one training step (glmtune's loss,
torch AdamW) gives PEFT's loss, gradients and updated adapters.

The default targets (`peft.target_modules: null`) are every Linear of attention and MLP and, on
Qwen3-MoE, the stacked routed experts, whose adapters fold into their weights as PEFT's
`target_parameters` do (peft/lora.py `LoRAFoldedExperts`). Tolerances: the same fp32 products, so
logits agree to rounding (atol 1e-6; observed equal); glmtune's loss is its chunked cross-entropy on
the final hidden states, PEFT's side transformers' logits and `F.cross_entropy`, so the loss and the
gradients agree to fp32 rounding (rtol 1e-5, atol 1e-6 on gradients of order 0.1), as in
test_hf_spec.py.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from glmtune.config.schema import PeftConfig
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.hf.spec import HF
from glmtune.peft import adapter_state, apply_lora, export_adapter, lora_modules, merge_lora
from glmtune.peft.adapter_load import apply_adapter
from glmtune.peft.lora import LoRAFoldedExperts, adapters_disabled

from .conftest import packed_batch

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

ATTENTION = ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj"]
DEFAULTS = {"llama": [*ATTENTION, "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"],
            "qwen3": [*ATTENTION, "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"],
            "glm4": [*ATTENTION, "*.mlp.gate_up_proj", "*.mlp.down_proj"],
            "qwen3_moe": [*ATTENTION, "*.mlp.experts"]}


def reference(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def adapted(path, seed: int = 0, **changes) -> torch.nn.Module:
    """glmtune's model of `path` with LoRA on the family's default targets, every adapter non-zero
    (a fresh adapter, B = 0, would prove nothing)."""
    model = HF.weights.load_pretrained(path, torch.float32, "cpu")
    apply_lora(model, PeftConfig(**{"method": "lora", "rank": 4, "alpha": 8.0, **changes}), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def with_peft(path, adapter_dir, trainable: bool = False):
    """transformers' model of `path` with the adapter loaded by PEFT; the load's warnings about
    missing or unexpected keys."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(reference(path), adapter_dir, is_trainable=trainable)
    problems = [str(w.message) for w in caught if "missing" in str(w.message).lower()
                or "unexpected" in str(w.message).lower()]
    return model, problems


def test_default_targets_are_every_linear_of_attention_and_mlp(tiny_dir):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    inventory = apply_lora(model, PeftConfig(method="lora", rank=4), seed=0)
    model_type = json.loads((tiny_dir / "config.json").read_text())["model_type"]
    assert inventory.target_modules == DEFAULTS[model_type]
    adapted_names = {name for name, _ in lora_modules(model)}
    linears = {name for name, module in reference(tiny_dir).named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    experts = {name for name in adapted_names if name.endswith(".mlp.experts")}
    assert adapted_names - experts == linears  # every Linear but the head; the experts of each MoE layer
    assert len(experts) == (2 if model_type == "qwen3_moe" else 0)
    assert all(isinstance(module, LoRAFoldedExperts) for name, module in lora_modules(model) if name in experts)


@pytest.mark.parametrize("changes", [
    dict(),
    dict(rslora=True, alpha=6.0, exclude_modules=["model.layers.1.self_attn.q_proj", "model.layers.0.*.down_proj"]),
], ids=["defaults", "rslora-excluded"])
def test_peft_loads_the_export_with_our_logits(tiny_dir, tmp_path, changes):
    ours = adapted(tiny_dir, **changes).eval()
    out = export_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(tiny_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    if "experts" in str(lora_modules(ours)):  # transformers' stacked experts: PEFT's target_parameters
        assert any(entry.endswith("mlp.experts.down_proj") for entry in config["target_parameters"])
    theirs, problems = with_peft(tiny_dir, out)
    assert problems == []
    saved, loaded = load_file(out / "adapter_model.safetensors"), get_peft_model_state_dict(theirs)
    assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))[:6]  # no missing, no unexpected keys
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key
    ids = packed_batch([14], seed=4)["input_ids"]
    with torch.no_grad():
        actual, expected, base = ours(ids).logits, theirs.eval()(ids).logits, reference(tiny_dir)(ids).logits
    assert (base - actual).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def reference_loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum")


def ours_in_peft_layout(model, grads: bool) -> dict[str, torch.Tensor]:
    """The adapters (or their gradients) keyed and shaped as in the PEFT file (`adapter_state`)."""
    if grads:
        values = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
        model = copy.deepcopy(model)
        with torch.no_grad():
            for name, value in values.items():
                model.get_parameter(name).copy_(value)
    return adapter_state(model)[1]


def theirs_in_peft_layout(model, grads: bool) -> dict[str, torch.Tensor]:
    return {"base_model.model." + name.removeprefix("base_model.model.").replace(".default", ""):
            (param.grad if grads else param).detach() for name, param in model.named_parameters() if param.requires_grad}


def test_one_training_step_equals_peft_and_adamw(tiny_dir, tmp_path):
    ours = adapted(tiny_dir, seed=1)
    theirs, _ = with_peft(tiny_dir, export_adapter(ours, tmp_path / "adapter"), trainable=True)
    batch = packed_batch([16], seed=1)
    loss, count = HF.compute.loss(ours, MicroBatch(**batch))  # glmtune's training loss
    expected = reference_loss(theirs, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    (loss / count).backward()
    (expected / count).backward()
    ours_grads, theirs_grads = ours_in_peft_layout(ours, grads=True), theirs_in_peft_layout(theirs, grads=True)
    assert ours_grads.keys() == theirs_grads.keys()
    for key, grad in ours_grads.items():
        assert grad.abs().max() > 0, key
        torch.testing.assert_close(grad, theirs_grads[key], rtol=1e-5, atol=1e-6)
    for model in (ours, theirs):  # eps 1e-4: test_hf_spec.py says why
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-4).step()
    stepped, expected_step = ours_in_peft_layout(ours, grads=False), theirs_in_peft_layout(theirs, grads=False)
    for key, tensor in stepped.items():
        torch.testing.assert_close(tensor, expected_step[key], rtol=1e-5, atol=1e-5)


def test_adapters_off_is_the_base_model(tiny_dir):
    """A LoRA preference run's reference model: the same modules with their adapters off (the folded
    experts' forward reads the base weights then), and the adapters back on after."""
    ours = adapted(tiny_dir).eval()
    ids = packed_batch([11], seed=6)["input_ids"]
    with torch.no_grad():
        on = ours(ids).logits
        with adapters_disabled(ours):
            off = ours(ids).logits
        assert torch.equal(ours(ids).logits, on)
    assert torch.equal(off, reference(tiny_dir)(ids).logits)
    assert (on - off).abs().max() > 1e-2


def test_the_export_applies_unmerged_and_merges_in_memory(tiny_dir, tmp_path):
    """`apply_adapter` (eval's unmerged adapter) rebuilds glmtune's adapted model from the export, and
    `merge_lora` folds it into plain transformers modules (the experts their own class again)."""
    ours = adapted(tiny_dir, seed=3).eval()
    out = export_adapter(ours, tmp_path / "adapter")
    ids = packed_batch([12], seed=7)["input_ids"]
    reloaded = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu").eval()
    assert apply_adapter(reloaded, out).modules == len(lora_modules(ours))
    with torch.no_grad():
        expected = ours(ids).logits
        assert torch.equal(reloaded(ids).logits, expected)
        merged = merge_lora(reloaded)
        assert lora_modules(merged) == [] and {type(m) for m in merged.modules()} <= {type(m) for m in
                                                                                      reference(tiny_dir).modules()}
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
