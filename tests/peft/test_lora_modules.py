"""LoRALinear and LoRAGroupedExperts: the math, init, dtypes, routing locality, merge."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from glmtune.models.glm5.moe import GroupedExperts
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear, LoraSpec
from glmtune.peft.merge import merge_lora


def _linear(dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(32, 48, bias=True).to(dtype)


def test_lora_linear_shares_base_and_starts_as_identity():
    base = _linear()
    lora = LoRALinear.from_linear(base, LoraSpec(rank=4, alpha=8))
    assert lora.weight is base.weight and lora.bias is base.bias
    assert lora.lora_A.weight.dtype == torch.float32 and not lora.lora_B.weight.any()
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)), as PEFT
    assert 0 < lora.lora_A.weight.abs().max() <= bound
    x = torch.randn(5, 32)
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)
    assert isinstance(lora.lora_dropout, nn.Identity)


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_linear_math(rslora):
    base = _linear()
    lora = LoRALinear.from_linear(base, LoraSpec(rank=4, alpha=6, rslora=rslora))
    nn.init.normal_(lora.lora_B.weight)
    scale = 6 / (2.0 if rslora else 4.0)
    assert lora.scaling == scale
    x = torch.randn(5, 32)
    expected = base(x) + scale * (x @ lora.lora_A.weight.T @ lora.lora_B.weight.T)
    torch.testing.assert_close(lora(x), expected)


def test_lora_linear_bf16_base_fp32_adapter():
    base = _linear(torch.bfloat16)
    lora = LoRALinear.from_linear(base, LoraSpec(rank=4, alpha=8))
    nn.init.normal_(lora.lora_B.weight)
    out = lora(torch.randn(3, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and lora.weight.dtype == torch.bfloat16
    assert lora.lora_A.weight.dtype == lora.lora_B.weight.dtype == torch.float32


def test_lora_dropout_on_input_only_in_training():
    lora = LoRALinear.from_linear(_linear(), LoraSpec(rank=4, alpha=8, dropout=0.5))
    nn.init.normal_(lora.lora_B.weight)
    x = torch.randn(64, 32)
    lora.eval()
    torch.testing.assert_close(lora(x), lora(x))
    lora.train()
    assert not torch.equal(lora(x), lora(x))  # dropout is live on the adapter path


def _experts(num_experts=4, dim=16, hidden=8, backend="grouped_mm") -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts, dim, hidden, backend)
    experts.reset_parameters(0.2)
    return experts


def _reference(experts: LoRAGroupedExperts, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-expert, per-projection W x + s B A x, written out expert by expert."""
    out, start, s = [], 0, experts.scaling
    for e, n in enumerate(counts):
        x = x_ND[start:start + n]
        start += n
        gu_a, gu_b = experts.adapter("gate_up_proj")
        d_a, d_b = experts.adapter("down_proj")
        gate_up = x @ experts.gate_up_proj[e].T + s * x @ gu_a[e].T @ gu_b[e].T
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out.append(h @ experts.down_proj[e].T + s * h @ d_a[e].T @ d_b[e].T)
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_grouped_expert_lora_matches_per_expert_reference(backend):
    experts = LoRAGroupedExperts.from_experts(_experts(backend=backend), LoraSpec(4, 8), ("gate_up_proj", "down_proj"))
    assert experts.lora_gate_up_A.shape == (4, 4, 16) and experts.lora_gate_up_B.shape == (4, 16, 4)
    assert experts.lora_down_A.shape == (4, 4, 8) and experts.lora_down_B.shape == (4, 16, 4)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 16)
    torch.testing.assert_close(experts(x, torch.tensor(counts)), _reference(experts, x, counts))


def test_only_routed_experts_get_adapter_gradients():
    experts = LoRAGroupedExperts.from_experts(_experts(), LoraSpec(4, 8), ("gate_up_proj", "down_proj"))
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    counts = torch.tensor([3, 0, 5, 0])
    experts(torch.randn(8, 16), counts).square().sum().backward()
    for name in ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B"):
        grad = getattr(experts, name).grad
        assert grad[[0, 2]].abs().sum() > 0, name
        assert not grad[[1, 3]].any(), f"{name}: an expert with no tokens got a gradient"


def test_single_projection_and_merge():
    experts = LoRAGroupedExperts.from_experts(_experts(), LoraSpec(4, 8), ("down_proj",))
    assert experts.lora_gate_up_A is None and experts.targets == ("down_proj",)
    nn.init.normal_(experts.lora_down_B)
    model = nn.Sequential()
    model.add_module("experts", experts)
    x, counts = torch.randn(10, 16), torch.tensor([1, 4, 0, 5])
    before = experts(x, counts)
    merge_lora(model)
    assert type(model.experts) is GroupedExperts and model.experts.down_proj is experts.down_proj
    torch.testing.assert_close(model.experts(x, counts), before, rtol=1e-5, atol=1e-5)
