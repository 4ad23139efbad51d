"""GLM-5's MoE runs its shared experts between the dispatcher's `*_start` and `*_finish` halves
(so expert parallelism's all-to-alls are in flight meanwhile): the output and every gradient
must be bit-identical to the plain schedule (dispatch, experts, combine, then the shared
experts), which is what the layer computed before the reordering.

The plain schedule here is the reference written out; bit-identity of x's gradient holds only
if autograd accumulates x's three contributions (the shared experts' up and gate projections,
then the routed path) in the same order, which the backward's node order decides.
"""

from __future__ import annotations

import pytest
import torch

from glmtune.models.common.token_dispatch import LocalTokenDispatcher
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.moe import MoE


def _plain_schedule(moe: MoE, x_BSD: torch.Tensor) -> torch.Tensor:
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    _, topk_w_TK, topk_idx_TK = moe.gate(x_TD)
    x_RD, tokens_per_expert_L, state = moe.dispatcher.dispatch(x_TD, topk_idx_TK, topk_w_TK, moe.num_experts)
    y_RD = moe.experts(x_RD, tokens_per_expert_L)
    routed_TD = moe.dispatcher.combine(y_RD, state, x_TD.dtype)
    return routed_TD.view_as(x_BSD) + moe.shared_experts(x_BSD)


def _output_and_grads(moe: MoE, x_BSD: torch.Tensor, forward) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x = x_BSD.detach().requires_grad_()
    out = forward(moe, x)
    # A gradient that is not all ones, so every contribution's rounding matters.
    out.backward(torch.linspace(-1.0, 1.0, out.numel()).view_as(out).to(out.dtype))
    grads = {name: p.grad.clone() for name, p in moe.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "x.grad": x.grad, **grads}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_overlapped_schedule_is_bit_identical_to_the_plain_one(dtype, backend):
    args = get_preset("tiny")
    torch.manual_seed(0)
    moe = MoE(args).to(dtype)
    moe.reset_parameters(0.05)
    moe.dispatcher = LocalTokenDispatcher(backend)
    x_BSD = torch.randn(2, 13, args.hidden_size, dtype=dtype)
    overlapped = _output_and_grads(moe, x_BSD, MoE.forward)
    plain = _output_and_grads(moe, x_BSD, _plain_schedule)
    assert sorted(overlapped) == sorted(plain)
    assert "shared_experts.gate_proj.weight" in plain and "experts.down_proj" in plain
    for name, expected in plain.items():
        assert torch.equal(overlapped[name], expected), name
