"""A frozen FP8 base (`glmtune/models/glm5/fp8_base.py`): the converted model computes
what the same model with its quantized weights dequantized computes (loss and every
gradient), LoRA adapters upstream of every FP8 layer get their gradients, and what
stays bf16/fp32 is what the official FP8 checkpoints keep unquantized."""

from __future__ import annotations

import copy

import pytest
import torch

from glmtune.config.schema import PeftConfig
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.kernels import fp8_blocks
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.fp8_base import Fp8Linear, convert_to_fp8_base
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.moe import GroupedExperts
from glmtune.peft import apply_lora


def _dequantized_twin(model):
    """The model with every weight that conversion quantizes replaced by its dequantized value."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) or (
                    name.endswith(".weight") and isinstance(twin.get_submodule(name[:-7]), torch.nn.Linear)
                    and _would_quantize(name[:-7])):
                param.copy_(fp8_blocks.dequantize(*fp8_blocks.quantize_weight(param), param.dtype))
    return twin


def _would_quantize(module_name):
    dotted = f".{module_name}."
    return (".self_attn." in dotted and ".indexer." not in dotted) or ".mlp." in dotted


def _step(model, x):
    out = model(x, MicroBatch(x, targets=torch.roll(x, -1, 1)))
    (out.loss_sum / out.num_targets).backward()
    return out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _randomize_adapters(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # B is zero at init: give every update a path to the loss
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))


def test_conversion_keeps_unquantized_what_the_checkpoints_keep():
    model = build_model(get_preset("tiny"), seed=0)
    names = convert_to_fp8_base(model)
    fp8 = {n for n, p in model.named_parameters() if fp8_blocks.is_fp8(p)}
    assert fp8 and all(not p.requires_grad for n, p in model.named_parameters() if n in fp8 or "_scale_inv" in n)
    assert any(".mlp.experts.gate_up_proj" in n for n in fp8) and any(".shared_experts." in n for n in fp8)
    assert any(".self_attn.q_a_proj." in n for n in fp8) and any(".mlp.gate_proj." in n for n in fp8)
    for n in fp8:
        assert not any(part in n for part in ("embed", "lm_head", "norm", "indexer", ".mlp.gate.")), n
        assert f"{n}_scale_inv" in dict(model.named_parameters()), n
    assert isinstance(model.get_submodule("model.layers.0.self_attn.o_proj"), Fp8Linear)
    assert all(isinstance(model.get_submodule(n), (Fp8Linear, GroupedExperts)) for n in names)


def test_fp8_base_is_its_dequantized_model():
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), seed=0)
    twin = _dequantized_twin(model)
    convert_to_fp8_base(model)
    x = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
    loss, _ = _step(model, x)
    twin_loss, _ = _step(twin, x)
    torch.testing.assert_close(loss, twin_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["dequant", "emulated"])
def test_lora_on_an_fp8_base_gets_every_gradient(backend):
    """Every adapter, those upstream of FP8 layers included, gets a non-zero gradient; with
    the dequant backend each equals the dequantized model's (the same function)."""
    model = build_model(get_preset("tiny"), seed=0)
    twin = _dequantized_twin(model)
    convert_to_fp8_base(model, backend)
    # The target set this test's bound was measured with (kv_b_proj included: no longer a default since 2026-12-03)
    peft = PeftConfig(method="lora", rank=4, target_modules=[*DEFAULT_LORA_TARGETS, "*.self_attn.kv_b_proj"])
    for m in (model, twin):
        apply_lora(m, peft, seed=0)
        _randomize_adapters(m)
    x = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
    loss, grads = _step(model, x)
    twin_loss, twin_grads = _step(twin, x)
    assert grads.keys() == twin_grads.keys() and grads
    for name, grad in grads.items():
        assert ".lora_" in name and grad.abs().sum() > 0, name
        if backend == "dequant":
            torch.testing.assert_close(grad, twin_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        else:  # activations and output gradients through 1 x 128 e4m3 at every FP8 product: a
            # few percent per GEMM, compounding with depth and flipping some DSA top-k choices
            # (measured: loss 399.457 vs 399.464; adapter gradients 6-35% apart, cosine >= 0.95)
            assert torch.nn.functional.cosine_similarity(grad.flatten(), twin_grads[name].flatten(), 0) > 0.9, name
