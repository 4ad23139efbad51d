"""RMSNorm with transformers' GLM-5 numerics as two Triton kernels (`model.norm_backend`: triton, and auto on a CUDA GPU).

The eager norm (`glmtune.models.common.rmsnorm.RMSNorm`, the reference) runs five elementwise
kernels and a reduction forward, more backward, and saves an fp32 copy of its input for the
backward (4 bytes per element); on sft_4k's busiest rank its three passes (forward, recomputation,
backward) took 6% of the kernel time (docs/benchmarks.md, 2026-12-06, second entry). Here the
forward is one program per row, which saves the row's fp32 1/rms beside the input it already
has; the backward is one program per block of rows: each row's input gradient, and the block's
fp32 partial sum of the weight gradient (summed over blocks afterwards).

The roundings are the eager function's: the normalized row is rounded to the input's dtype
before the weight multiply, the product to the output's dtype (the promotion of input and
weight); backward, d(out)·w is rounded to the output's dtype, the weight gradient's terms
d(out)·normalized likewise, and the input gradient once, to the input's dtype. What differs is
the order of the fp32 row sums and the fused multiply-adds: a few fp32 ulps before rounding, so
a few bf16 results per million land a step or two from eager's (more steps for an input gradient
whose two terms cancel; `benchmarks/rms_norm.py` on an H100). `tests/kernels/test_rms_norm.py`
compares the two in Triton's CPU interpreter.

The kernels are custom ops (`glmtune::rms_norm`, `glmtune::rms_norm_backward`) so a compiled
layer calls them as they are.

Legend: M rows (every leading dim flattened), W the normalized width.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_PROGRAMS = 512  # backward: row blocks (and fp32 partial weight gradients) at most


def _forward_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, width, x_stride, out_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


def _backward_kernel(dout_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, width, rows_per_program,
                     dout_stride, x_stride, dx_stride, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = block * rows_per_program + i
        here = inside & (row + cols * 0 < rows)  # compared as a vector: Triton's interpreter refuses a
        # mask broadcast from a scalar
        dout = tl.load(dout_ptr + row * dout_stride + cols, mask=here, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_stride + cols, mask=here, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, rows - 1))  # past the last row: its loads are masked to 0
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        dw += (dout * normed).to(dout_ptr.dtype.element_ty).to(tl.float32)
        # autograd's d(out)·w, in the output's dtype, then cast to the normalized row's
        grad = (dout * w).to(dout_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty).to(tl.float32)
        dx = grad * rstd - x * (tl.sum(grad * x, axis=0) * rstd * rstd * rstd / width)
        tl.store(dx_ptr + row * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=here)
    tl.store(dw_ptr + block * width + cols, dw, mask=inside)


@functools.cache
def _kernel(fn):
    return triton.jit(fn)  # lazily: the CPU interpreter (TRITON_INTERPRET=1) may be switched on first


def _block(width: int) -> int:
    return triton.next_power_of_2(width)


@torch.library.custom_op("glmtune::rms_norm", mutates_args=())
def _rms_norm(x_MW: torch.Tensor, weight_W: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, W] in the promotion of x's and weight's dtypes, fp32 1/rms [M])."""
    rows, width = x_MW.shape
    out = torch.empty(rows, width, dtype=torch.promote_types(x_MW.dtype, weight_W.dtype), device=x_MW.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x_MW.device)
    if rows:
        _kernel(_forward_kernel)[(rows,)](x_MW, weight_W, out, rstd, width, x_MW.stride(0), out.stride(0), eps,
                                          BLOCK=_block(width), num_warps=8)
    return out, rstd


@_rms_norm.register_fake
def _(x_MW, weight_W, eps):
    out = x_MW.new_empty(x_MW.shape, dtype=torch.promote_types(x_MW.dtype, weight_W.dtype))
    return out, x_MW.new_empty(x_MW.shape[0], dtype=torch.float32)


@torch.library.custom_op("glmtune::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dout_MW: torch.Tensor, x_MW: torch.Tensor, weight_W: torch.Tensor,
                       rstd_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, W] in x's dtype, dweight [W] in the weight's dtype)."""
    rows, width = x_MW.shape
    dx = torch.empty_like(x_MW)
    programs = max(1, min(rows, MAX_PROGRAMS))
    rows_per_program = triton.cdiv(rows, programs) if rows else 0
    # each program writes its whole row; with no rows no program runs and the weight gradient is 0
    partial = (torch.empty if rows else torch.zeros)(programs, width, dtype=torch.float32, device=x_MW.device)
    if rows:
        _kernel(_backward_kernel)[(programs,)](dout_MW, x_MW, weight_W, rstd_M, dx, partial, rows, width,
                                               rows_per_program, dout_MW.stride(0), x_MW.stride(0), dx.stride(0),
                                               BLOCK=_block(width), num_warps=8)
    return dx, partial.sum(0).to(weight_W.dtype)


@_rms_norm_backward.register_fake
def _(dout_MW, x_MW, weight_W, rstd_M):
    return torch.empty_like(x_MW), torch.empty_like(weight_W)


def _setup_context(ctx, inputs, output):
    x_MW, weight_W, _ = inputs
    ctx.save_for_backward(x_MW, weight_W, output[1])


def _backward(ctx, grad_out, _grad_rstd):
    x_MW, weight_W, rstd_M = ctx.saved_tensors
    dx, dweight = _rms_norm_backward(grad_out.contiguous(), x_MW, weight_W, rstd_M)
    return dx, dweight if ctx.needs_input_grad[1] else None, None


_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm`'s forward through the kernels: x [..., W] (any leading dims), weight [W]."""
    width = x.shape[-1]
    x_MW = x.reshape(-1, width)  # a view where it can be: the kernels take a row stride (kv_a's latent slice)
    if x_MW.stride(1) != 1:
        x_MW = x_MW.contiguous()
    out_MW, _ = _rms_norm(x_MW, weight.contiguous(), eps)
    return out_MW.view(*x.shape[:-1], width)
