"""LoRA products with the sums in the base GEMM's output (`glmtune/kernels/lora_ops.py`)
against autograd through the explicit formula: values and every gradient, eager and
under torch.compile (the ops are opaque to it; their fake shapes must hold)."""

from __future__ import annotations

import pytest
import torch

from glmtune.kernels.lora_ops import lora_linear


def _leaves(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 24, generator=gen, dtype=torch.float64)
    a = torch.randn(6, 24, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(40, 6, generator=gen, dtype=torch.float64).requires_grad_()
    return x.requires_grad_(), w, a, b


def _explicit(x, w, a, b):
    return x @ w.T + (x @ a.T) @ b.T


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_linear_matches_the_formula(compiled):
    fn = torch.compile(lora_linear, fullgraph=True, backend="aot_eager") if compiled else lora_linear
    results = []
    for op in (fn, _explicit):
        x, w, a, b = _leaves()
        out = op(x, w, a, b)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, a.grad, b.grad))
    assert results[0][0].shape == (2, 5, 40)
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference, rtol=1e-12, atol=1e-12)


def test_lora_linear_refuses_a_trainable_base():
    x, w, a, b = _leaves()
    with pytest.raises(AssertionError, match="base weight"):
        lora_linear(x, w.requires_grad_(), a, b)
