"""Products with a frozen blockwise-FP8 weight (`fp8_blocks`): forward and input gradient.

A frozen weight needs two of a linear layer's three products: y = x W^T and dx = dy W.
Neither saves a dequantized copy of W for the backward: the autograd functions keep the
e4m3 weight and its scales only, so a model stored in FP8 stays FP8 through the step,
and the input gradient always flows (a frozen FP8 layer that dropped dx would silently
starve every LoRA adapter upstream of it).

Dense backends (`linear_fp8`):
  dequant     W dequantized to x's dtype (a transient), then the plain GEMM: the reference;
              runs everywhere.
  emulated    x (and dy) quantized per 1 x 128 block and dequantized again, W dequantized,
              GEMM in fp32: the arithmetic of the FP8 GEMM on any device (its CPU reference).
  scaled_mm   blockwise-scaled FP8 GEMMs on the GPU (`torch.nn.functional.scaled_mm`, x per
              1 x 128, W per 128 x 128; the input gradient through an FP8 transposed copy of
              W); dims that are not multiples of 128 take the dequant path.
  triton      the W8A16 kernel of the routed experts (`fp8_grouped_gemm.py`) over one group:
              the e4m3 weight read as it is and each tile dequantized on chip, the dequant
              path's operands; dims that are not multiples of 128 (and CPU tensors) take the
              dequant path.

Routed experts (`grouped_linear_fp8`, `GROUPED_BACKENDS`; the forward and the input gradient
go through the same one):
  dequant     the layer's stacked weight dequantized into a transient in the activations'
              dtype and the grouped bf16 GEMM (`grouped_gemm.py`; torch 2.11 has no
              blockwise-scaled grouped GEMM); the backward dequantizes again. The reference,
              and the default.
  triton      a grouped GEMM that reads the e4m3 weight and dequantizes each tile in registers
              (`fp8_grouped_gemm.py`): the same operands, no transient; widths that are not
              multiples of 128 take the dequant path.
  auto        triton for CUDA tensors where it can run, else dequant.

Legend: M rows, I input width, O output width, E experts.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from glmtune.kernels import fp8_blocks, fp8_grouped_gemm
from glmtune.kernels.grouped_gemm import grouped_linear
from glmtune.kernels.moe_combine import _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BACKENDS = ("dequant", "emulated", "scaled_mm", "triton")
GROUPED_BACKENDS = ("auto", "dequant", "triton")


def _scaled_mm_usable(w_q: torch.Tensor) -> bool:
    rows, cols = w_q.shape[-2:]
    return (w_q.is_cuda and hasattr(F, "scaled_mm") and rows % fp8_blocks.BLOCK == 0
            and cols % fp8_blocks.BLOCK == 0 and torch.cuda.get_device_capability(w_q.device) == (9, 0))


def _rhs_scale(scale: torch.Tensor) -> torch.Tensor:
    """[out blocks, reduction blocks] -> cuBLAS's layout: [round_up(red, 4), out], stride (1, ·)."""
    out_blocks, red_blocks = scale.shape
    padded = scale.new_zeros(out_blocks, -(-red_blocks // 4) * 4)
    padded[:, :red_blocks] = scale
    return padded.t()


def _fp8_gemm(a_MK: torch.Tensor, b_q_NK: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a @ b^T with a quantized here per 1 x 128 and b an e4m3 [N, K] (row-major) with 128 x 128 scales."""
    a_q, a_scale = fp8_blocks.quantize_rows(a_MK)
    return F.scaled_mm(a_q.contiguous(), b_q_NK.t(), a_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                       _rhs_scale(b_scale), F.ScalingType.BlockWise128x128, output_dtype=a_MK.dtype)


def _emulated(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    a = fp8_blocks.dequantize_rows(*fp8_blocks.quantize_rows(a_MK), torch.float32)
    return (a @ b_NK.float().t()).to(a_MK.dtype)


def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, rows, cols, scale_rows, scale_cols, BLOCK: tl.constexpr):
    # One program per 128 x 128 block: program 0 runs over (leading index, block row).
    lead, block_row = tl.program_id(0) // scale_rows, tl.program_id(0) % scale_rows
    block_col = tl.program_id(1)
    r = block_row * BLOCK + tl.arange(0, BLOCK)
    c = block_col * BLOCK + tl.arange(0, BLOCK)
    inside = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = lead.to(tl.int64) * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
    scale = tl.load(scale_ptr + (lead * scale_rows + block_row) * scale_cols + block_col)
    q = tl.load(q_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (q * scale).to(out_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _jit():
    return triton.jit(_dequantize_kernel)  # the CPU interpreter under TRITON_INTERPRET=1


def dequantize_fast(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8_blocks.dequantize` as one pass (a Triton kernel) where it can run; eager torch is
    five passes with an fp32 intermediate of the weight's size."""
    if triton is None or not (w_q.is_cuda or _interpreting()):
        return fp8_blocks.dequantize(w_q, w_scale, dtype)
    fp8_blocks.check_scale(tuple(w_q.shape), tuple(w_scale.shape))
    *lead, rows, cols = w_q.shape
    scale_rows, scale_cols = w_scale.shape[-2:]
    out = torch.empty(w_q.shape, dtype=dtype, device=w_q.device)
    if out.numel():
        grid = (math.prod(lead) * scale_rows, scale_cols)
        _jit()[grid](w_q.contiguous(), w_scale.float().contiguous(), out, rows, cols, scale_rows, scale_cols,
                     BLOCK=fp8_blocks.BLOCK)
    return out


def _one_group(x_MK: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor | None:
    """offsets [M] of a dense product on the W8A16 kernel (one group), or None where it cannot run."""
    if not fp8_grouped_gemm.usable(x_MK, w_q[None]):
        return None
    return torch.full((1,), x_MK.shape[0], dtype=torch.int64, device=x_MK.device)


def _forward(x_MI, w_q, w_scale, backend):
    if backend == "triton" and (offsets := _one_group(x_MI, w_q)) is not None:
        return fp8_grouped_gemm.fp8_grouped_linear(x_MI, w_q[None], w_scale[None], offsets)
    if backend == "scaled_mm" and _scaled_mm_usable(w_q):
        return _fp8_gemm(x_MI, w_q, w_scale)
    if backend == "emulated":
        return _emulated(x_MI, fp8_blocks.dequantize(w_q, w_scale, torch.float32))
    return x_MI @ dequantize_fast(w_q, w_scale, x_MI.dtype).t()


def _input_grad(grad_MO, w_q, w_scale, backend):
    if backend == "triton" and (offsets := _one_group(grad_MO, w_q)) is not None:
        return fp8_grouped_gemm.fp8_grouped_input_grad(grad_MO, w_q[None], w_scale[None], offsets)
    if backend == "scaled_mm" and _scaled_mm_usable(w_q):
        # dx = dy W: W as the [I, O] right operand in row-major e4m3, its block scales transposed.
        return _fp8_gemm(grad_MO, w_q.t().contiguous(), w_scale.t())
    if backend == "emulated":
        return _emulated(grad_MO, fp8_blocks.dequantize(w_q, w_scale, torch.float32).t())
    return grad_MO @ dequantize_fast(w_q, w_scale, grad_MO.dtype)


# Opaque to torch.compile on purpose: traced, the partitioner may keep the dequantized
# weight (an intermediate of the forward) for the backward instead of dequantizing again,
# and a model stored in FP8 would hold a bf16 copy of every layer until its backward.
@torch.library.custom_op("glmtune::linear_fp8", mutates_args=())
def _linear_fp8(x_MI: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, backend: str) -> torch.Tensor:
    return _forward(x_MI, w_q, w_scale, backend)


@_linear_fp8.register_fake
def _(x_MI, w_q, w_scale, backend):
    return x_MI.new_empty(x_MI.shape[0], w_q.shape[0])


@torch.library.custom_op("glmtune::linear_fp8_input_grad", mutates_args=())
def _linear_fp8_input_grad(grad_MO: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                           backend: str) -> torch.Tensor:
    return _input_grad(grad_MO.contiguous(), w_q, w_scale, backend)


@_linear_fp8_input_grad.register_fake
def _(grad_MO, w_q, w_scale, backend):
    return grad_MO.new_empty(grad_MO.shape[0], w_q.shape[1])


def _linear_setup(ctx, inputs, output):
    _, w_q, w_scale, backend = inputs
    ctx.save_for_backward(w_q, w_scale)
    ctx.backend = backend


def _linear_grad(ctx, grad_MO):
    w_q, w_scale = ctx.saved_tensors
    return _linear_fp8_input_grad(grad_MO, w_q, w_scale, ctx.backend), None, None, None


_linear_fp8.register_autograd(_linear_grad, setup_context=_linear_setup)


def linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, backend: str = "dequant") -> torch.Tensor:
    """x W^T for a frozen e4m3 W [O, I] with 128 x 128 `w_scale`; x [..., I] -> [..., O] in x's dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 matmul backend {backend!r} unknown; choose from {BACKENDS}")
    assert not w_q.requires_grad and fp8_blocks.is_fp8(w_q), "linear_fp8 takes a frozen FP8 weight"
    y = _linear_fp8(x.reshape(-1, x.shape[-1]), w_q, w_scale, backend)
    return y.view(*x.shape[:-1], w_q.shape[0])


def resolve_grouped_backend(backend: str, x_NI: torch.Tensor, w_q: torch.Tensor) -> str:
    """The routed experts' backend for this call: "dequant" or "triton" (see the module docstring).
    "auto" is triton for CUDA tensors where the kernel can take the weight, else dequant; an explicit
    "triton" falls back to dequant for widths that are not multiples of 128 and is a ValueError
    without triton or a CUDA device."""
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"fp8 grouped matmul backend {backend!r} unknown; choose from {GROUPED_BACKENDS}")
    if backend == "triton" and not fp8_grouped_gemm.runs_on(x_NI.device):
        raise ValueError("fp8 grouped matmul backend 'triton' needs triton and a CUDA device")
    if backend == "dequant" or not fp8_grouped_gemm.usable(x_NI, w_q):
        return "dequant"
    return "triton" if backend == "triton" or x_NI.is_cuda else "dequant"


@torch.library.custom_op("glmtune::grouped_linear_fp8", mutates_args=())
def _grouped_linear_fp8(x_NI: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        offsets_E: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "triton":
        return fp8_grouped_gemm.fp8_grouped_linear(x_NI, w_q, w_scale, offsets_E)
    return grouped_linear(x_NI, dequantize_fast(w_q, w_scale, x_NI.dtype), offsets_E, "grouped_mm")


@_grouped_linear_fp8.register_fake
def _(x_NI, w_q, w_scale, offsets_E, backend):
    return x_NI.new_empty(x_NI.shape[0], w_q.shape[1])


@torch.library.custom_op("glmtune::grouped_linear_fp8_input_grad", mutates_args=())
def _grouped_linear_fp8_input_grad(grad_NO: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                   offsets_E: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "triton":
        return fp8_grouped_gemm.fp8_grouped_input_grad(grad_NO, w_q, w_scale, offsets_E)
    w = dequantize_fast(w_q, w_scale, grad_NO.dtype)
    return grouped_linear(grad_NO.contiguous(), w.transpose(1, 2), offsets_E, "grouped_mm")


@_grouped_linear_fp8_input_grad.register_fake
def _(grad_NO, w_q, w_scale, offsets_E, backend):
    return grad_NO.new_empty(grad_NO.shape[0], w_q.shape[2])


def _grouped_setup(ctx, inputs, output):
    _, w_q, w_scale, offsets_E, backend = inputs
    ctx.save_for_backward(w_q, w_scale, offsets_E)
    ctx.backend = backend


def _grouped_grad(ctx, grad_NO):
    w_q, w_scale, offsets_E = ctx.saved_tensors
    return _grouped_linear_fp8_input_grad(grad_NO, w_q, w_scale, offsets_E, ctx.backend), None, None, None, None


_grouped_linear_fp8.register_autograd(_grouped_grad, setup_context=_grouped_setup)


def grouped_linear_fp8(x_NI: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       offsets_E: torch.Tensor, backend: str = "dequant") -> torch.Tensor:
    """y[n] = x[n] @ W[e(n)]^T for a frozen stacked e4m3 W [E, O, I] (rows grouped by expert);
    `backend` one of GROUPED_BACKENDS, its input gradient through the same backend."""
    assert not w_q.requires_grad and fp8_blocks.is_fp8(w_q), "grouped_linear_fp8 takes a frozen FP8 weight"
    return _grouped_linear_fp8(x_NI, w_q, w_scale, offsets_E, resolve_grouped_backend(backend, x_NI, w_q))
