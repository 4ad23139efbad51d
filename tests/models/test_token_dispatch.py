"""The local token dispatcher against a per-token loop, in value and in every gradient; the
routed-experts layers found through the contract (`expert_layers`), whatever the model."""

import torch
from torch import nn

from glmtune.models.common.token_dispatch import LocalTokenDispatcher, expert_layers
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import MoE


def test_dispatch_combine_equals_per_token_loop():
    torch.manual_seed(0)
    tokens, dim, experts, top_k = 13, 6, 5, 3
    x = torch.randn(tokens, dim, dtype=torch.float64, requires_grad=True)
    w_expert = torch.randn(experts, dim, dim, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    gate = torch.rand(tokens, top_k, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(tokens, dim, dtype=torch.float64)

    dispatcher = LocalTokenDispatcher()
    x_sorted, per_expert, state = dispatcher.dispatch(x, idx, gate, experts)
    assert per_expert.tolist() == torch.bincount(idx.reshape(-1), minlength=experts).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(experts), per_expert)
    y_sorted = torch.einsum("nd,nde->ne", x_sorted, w_expert[expert_of_row])
    out = dispatcher.combine(y_sorted, state, torch.float64)
    (out * upstream).sum().backward()
    got = out.detach(), x.grad.clone(), w_expert.grad.clone(), gate.grad.clone()

    x.grad = w_expert.grad = gate.grad = None
    ref = torch.stack([sum(gate[t, k] * (x[t] @ w_expert[idx[t, k]]) for k in range(top_k)) for t in range(tokens)])
    (ref * upstream).sum().backward()
    for mine, theirs in zip(got, (ref.detach(), x.grad, w_expert.grad, gate.grad)):
        assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-12)


def test_expert_layers_are_found_by_the_contract():
    # GLM-5: every MoE layer, the MTP layer's included, and nothing else.
    model = build_model(get_preset("tiny"), device="meta")
    assert expert_layers(model) == [m for m in model.modules() if isinstance(m, MoE)]
    assert len(expert_layers(model)) > 0

    # Any module with a dispatcher, an experts module and a number of experts, of no family.
    class Layer(nn.Module):
        def __init__(self, dispatcher):
            super().__init__()
            self.dispatcher, self.experts, self.num_experts = dispatcher, nn.Linear(2, 2), 4

    other = nn.Sequential(Layer(LocalTokenDispatcher()), Layer(None), nn.Linear(2, 2))
    assert expert_layers(other) == [other[0]]
