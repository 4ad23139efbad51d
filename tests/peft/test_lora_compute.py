"""The fast adapter path (`peft.adapter_compute: base`: fp32 adapters, bf16 products, the
scale folded into B, grouped GEMMs for the routed experts) against the fp32 reference
(PEFT's way: inputs cast up, fp32 products), on a bf16 base: values and gradients agree
to bf16 accuracy, and the adapters' gradients stay fp32 (they are master weights)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from glmtune.models.glm5.moe import GroupedExperts
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear, LoraSpec


def _randomize(module: nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _pair(make, compute_fast="base"):
    fast = make(LoraSpec(8, 16, compute=compute_fast))
    _randomize(fast)
    ref = copy.deepcopy(fast)
    ref.spec = LoraSpec(8, 16, compute="fp32")
    for module in (fast, ref):
        for name, p in module.named_parameters():
            p.requires_grad_("lora_" in name)
    return fast, ref


def test_linear_fast_path_matches_fp32_reference():
    torch.manual_seed(0)
    base = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    fast, ref = _pair(lambda spec: LoRALinear.from_linear(copy.deepcopy(base), spec))
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    out_fast, out_ref = fast(x), ref(x)
    assert out_fast.dtype == out_ref.dtype == torch.bfloat16
    assert _rel(out_fast, out_ref) < 1e-2
    grad = torch.randn_like(out_ref)
    out_fast.backward(grad)
    out_ref.backward(grad)
    for name in ("lora_A", "lora_B"):
        g_fast, g_ref = getattr(fast, name).weight.grad, getattr(ref, name).weight.grad
        assert g_fast.dtype == torch.float32
        assert _rel(g_fast, g_ref) < 2e-2, name


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_expert_fast_path_matches_fp32_reference(backend):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 16, backend)
    experts.reset_parameters(0.2)
    experts = experts.to(torch.bfloat16)
    fast, ref = _pair(lambda spec: LoRAGroupedExperts.from_experts(copy.deepcopy(experts), spec,
                                                                   ("gate_up_proj", "down_proj")))
    counts = torch.tensor([9, 0, 14, 7])
    x = torch.randn(int(counts.sum()), 32, dtype=torch.bfloat16)
    out_fast, out_ref = fast(x, counts), ref(x, counts)
    assert _rel(out_fast, out_ref) < 1e-2
    grad = torch.randn_like(out_ref)
    out_fast.backward(grad)
    out_ref.backward(grad)
    for name in ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B"):
        g_fast, g_ref = getattr(fast, name).grad, getattr(ref, name).grad
        assert g_fast.dtype == torch.float32
        assert not g_fast[1].any(), f"{name}: expert 1 got no tokens"
        assert _rel(g_fast, g_ref) < 2e-2, name


@pytest.mark.parametrize("bias", [True, False])  # without a bias the base GEMM adds the update (addmm)
def test_fp32_base_paths_are_the_same_function(bias):
    """On an fp32 base both settings compute in fp32: where the update is added and the scale
    folded into B are the only differences (rounding order)."""
    torch.manual_seed(0)
    base = nn.Linear(64, 96, bias=bias)
    fast, ref = _pair(lambda spec: LoRALinear.from_linear(copy.deepcopy(base), spec))
    x = torch.randn(2, 10, 64)
    torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)
    expected = base(x) + fast.scaling * (x @ fast.lora_A.weight.T @ fast.lora_B.weight.T)
    torch.testing.assert_close(fast(x), expected, rtol=1e-5, atol=1e-5)
