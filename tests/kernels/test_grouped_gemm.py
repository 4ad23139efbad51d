"""The grouped GEMM (`glmtune/kernels/grouped_gemm.py`): the `grouped_mm` backend against the
per-expert loop (the reference), values and gradients, for uneven groups with an empty
expert, and a width whose strides the CPU kernel refuses (the fallback to the loop)."""

from __future__ import annotations

import pytest
import torch

from glmtune.kernels.grouped_gemm import _grouped_mm_usable, grouped_linear


def _run(backend, x, w, offsets, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(x, w, offsets, backend)
    (y * grad).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("in_dim", [32, 30])  # 30 fp32 columns: rows not 16-byte aligned
def test_grouped_mm_matches_the_loop(in_dim):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 9])  # expert 1 gets no row
    x = torch.randn(int(counts.sum()), in_dim, generator=gen)
    w = torch.randn(len(counts), 24, in_dim, generator=gen)
    offsets = torch.cumsum(counts, 0)
    grad = torch.randn(x.shape[0], 24, generator=gen)
    assert _grouped_mm_usable(x, w) == (in_dim == 32)
    fast, loop = _run("grouped_mm", x, w, offsets, grad), _run("loop", x, w, offsets, grad)
    for got, want in zip(fast, loop):
        torch.testing.assert_close(got, want)
    assert loop[2][1].abs().max() == 0  # no row, no gradient
    torch.testing.assert_close(loop[0][5:22], x[5:22] @ w[2].T)
