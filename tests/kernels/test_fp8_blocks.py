"""The blockwise FP8 format (`glmtune/kernels/fp8_blocks.py`) and the frozen-FP8 products
(`glmtune/kernels/fp8_matmul.py`) against explicit dequantized references: values and
input gradients, partial blocks, stacked experts, and no dequantized weight kept for the
backward."""

from __future__ import annotations

import pytest
import torch

from glmtune.kernels import fp8_blocks
from glmtune.kernels.fp8_matmul import grouped_linear_fp8, linear_fp8
from glmtune.kernels.grouped_gemm import grouped_linear
from glmtune.models.glm5.state_dict_adapter import dequantize_fp8_block


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 136, 256)])
def test_quantize_weight_round_trips_within_e4m3_precision(shape):
    w = _rand(*shape, scale=0.02)
    q, scale = fp8_blocks.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(scale.shape) == fp8_blocks.scale_shape(shape)
    back = fp8_blocks.dequantize(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: each value within half a step of 2^-3 of itself, or of half
    # the subnormal step 2^-9 of its block's scale; a block's largest magnitude comes back exactly.
    block_scale = fp8_blocks.dequantize(torch.ones(shape).to(torch.float8_e4m3fn), scale, torch.float32)
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, block_scale * 2**-10)).all()
    block_max = fp8_blocks._padded_blocks(w.abs()).amax(dim=(-3, -1))
    assert torch.equal(fp8_blocks._padded_blocks(back.abs()).amax(dim=(-3, -1)), block_max)
    if len(shape) == 2:  # the checkpoint loader's dequantization is this one
        assert torch.equal(dequantize_fp8_block(q, scale, torch.float32), back)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 136, 256)])
def test_quantize_with_error_is_quantize_weight_and_its_fp64_error(shape):
    """The same e4m3 weight and scales, bit for bit; the squared error and norm those of a float64
    computation to 1e-5 (each square's sum in fp32 terms: far inside the 3 digits reported)."""
    w = _rand(*shape, scale=0.02).to(torch.bfloat16)
    q, scale = fp8_blocks.quantize_weight(w)
    q2, scale2, (error, norm) = fp8_blocks.quantize_weight_with_error(w)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)
    back = fp8_blocks.dequantize(q, scale, torch.float64)
    assert error == pytest.approx((back - w.double()).square().sum().item(), rel=1e-5)
    assert norm == pytest.approx(w.double().square().sum().item(), rel=1e-5)
    assert 0 < error < 1e-2 * norm


def test_dequantize_names_a_wrong_scale_shape():
    q, scale = fp8_blocks.quantize_weight(_rand(256, 256))
    with pytest.raises(ValueError, match=r"weight_scale_inv shape \(2, 1\) does not match weight \(256, 256\)"):
        fp8_blocks.dequantize(q, scale[:, :1], torch.float32)


def test_quantize_rows_is_per_128_block_of_a_row():
    x = _rand(5, 300)
    x[2, 130:140] *= 1000  # one block with an outlier: the others keep their precision
    q, scale = fp8_blocks.quantize_rows(x)
    assert scale.shape == (5, 3)
    back = fp8_blocks.dequantize_rows(q, scale, torch.float32)
    row_scale = scale.repeat_interleave(128, 1)[:, :300]
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, row_scale * 2**-10)).all()
    assert torch.allclose(back[2, :128], x[2, :128], rtol=2**-4)


def _frozen_fp8(out_dim, in_dim, lead=()):
    q, scale = fp8_blocks.quantize_weight(_rand(*lead, out_dim, in_dim, seed=1, scale=0.05))
    return q, scale, fp8_blocks.dequantize(q, scale, torch.float64)


@pytest.mark.parametrize("backend", ["dequant", "emulated"])
def test_linear_fp8_values_and_input_gradient(backend):
    q, scale, w = _frozen_fp8(200, 256)
    x = _rand(2, 7, 256, seed=2).double().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_fp8(x, q, scale, backend)
    assert all(t.dtype in (torch.float8_e4m3fn, torch.float32) for t in saved), "a dequantized weight was saved"
    grad = _rand(2, 7, 200, seed=3).double()
    y.backward(grad)
    if backend == "dequant":
        torch.testing.assert_close(y, x.detach() @ w.T)
        torch.testing.assert_close(x.grad, grad @ w)
    else:  # the FP8 GEMM's arithmetic: x and dy quantized per 1 x 128 block, fp32 products
        xe = fp8_blocks.dequantize_rows(*fp8_blocks.quantize_rows(x.detach().reshape(14, 256)), torch.float32)
        ge = fp8_blocks.dequantize_rows(*fp8_blocks.quantize_rows(grad.reshape(14, 200)), torch.float32)
        torch.testing.assert_close(y.reshape(14, 200), (xe @ w.float().T).double())
        torch.testing.assert_close(x.grad.reshape(14, 256), (ge @ w.float()).double())
        rel = (y - x.detach() @ w.T).norm() / (x.detach() @ w.T).norm()
        assert 0 < rel < 0.05  # activation quantization: a few percent, as on the GPU


def test_linear_fp8_refuses_a_trainable_or_non_fp8_weight():
    q, scale, w = _frozen_fp8(128, 128)
    with pytest.raises(AssertionError, match="frozen FP8 weight"):
        linear_fp8(_rand(3, 128), w.float(), scale)
    with pytest.raises(ValueError, match="fp8 matmul backend 'fast' unknown"):
        linear_fp8(_rand(3, 128), q, scale, "fast")


def test_grouped_linear_fp8_matches_dequantized_experts():
    q, scale, w = _frozen_fp8(136, 256, lead=(4,))
    counts = torch.tensor([5, 0, 9, 2])
    offsets = torch.cumsum(counts, 0)
    x = _rand(16, 256, seed=4).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_linear_fp8(x, q, scale, offsets)
    assert not any(t.shape == q.shape and t.dtype != q.dtype for t in saved), "a dequantized weight was saved"
    grad = _rand(16, 136, seed=5)
    y.backward(grad)
    xr = x.detach().clone().requires_grad_()
    ref = grouped_linear(xr, w.float(), offsets, "loop")
    ref.backward(grad)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, xr.grad)


def test_fp8_products_compile_as_opaque_ops():
    """Under torch.compile the products stay ops of their own (the partitioner cannot keep a
    dequantized weight for the backward) and compute what eager does."""
    q, scale, _ = _frozen_fp8(128, 256)
    gq, gscale, _ = _frozen_fp8(136, 128, lead=(3,))
    offsets = torch.tensor([4, 4, 12])

    def layer(x):
        return grouped_linear_fp8(linear_fp8(x, q, scale).repeat(1, 1), gq, gscale, offsets)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        x = _rand(12, 256, seed=6).requires_grad_()
        y = fn(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad))
    for mine, reference in zip(*results):
        torch.testing.assert_close(mine, reference)
