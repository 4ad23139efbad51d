"""The Triton MoE token-movement kernels against the torch reference dispatcher: output
and every gradient (tokens, expert weights, routing weights), K not a power of two.

Runs in Triton's CPU interpreter in a child process (fp32); GPU bf16 training is checked
against transformers by benchmarks/throughput.py.
"""

import pytest
import torch
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def _route(dispatcher, x, w_expert, idx, gate, upstream):
    from glmtune.kernels.grouped_gemm import grouped_linear

    x_sorted, per_expert, state = dispatcher.dispatch(x, idx, gate, w_expert.shape[0])
    y_sorted = grouped_linear(x_sorted, w_expert, torch.cumsum(per_expert, 0), "loop")
    out = dispatcher.combine(y_sorted, state, x.dtype)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, w_expert.grad, gate.grad


def check_triton_dispatch_matches_torch():
    from glmtune.models.common.token_dispatch import LocalTokenDispatcher

    gen = torch.Generator().manual_seed(0)
    tokens, dim, experts, top_k = 19, 1030, 6, 3  # dim spans two 1024-wide column blocks
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    base = (torch.randn(tokens, dim, generator=gen), torch.randn(experts, dim, dim, generator=gen) * 0.03,
            torch.rand(tokens, top_k, generator=gen), torch.randn(tokens, dim, generator=gen))
    results = []
    for backend in ("torch", "triton"):
        x, w_expert, gate = (t.clone().requires_grad_() for t in base[:3])
        results.append(_route(LocalTokenDispatcher(backend), x, w_expert, idx, gate, base[3]))
    for mine, reference in zip(results[1], results[0]):
        assert torch.allclose(mine, reference, rtol=1e-5, atol=1e-5), (mine - reference).abs().max()


def check_empty_batch():
    from glmtune.kernels.moe_combine import moe_combine, moe_sum_pairs

    empty = torch.empty(0, 8)
    assert moe_combine(empty, torch.empty(0, dtype=torch.long), torch.empty(0, 2)).shape == (0, 8)
    assert moe_sum_pairs(empty, torch.empty(0, dtype=torch.long), 2).shape == (0, 8)


def test_moe_kernels_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_triton_dispatch_matches_torch", "check_empty_batch"]


if __name__ == "__main__":
    main(check_triton_dispatch_matches_torch, check_empty_batch)
