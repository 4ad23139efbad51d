"""MoE token movement as Triton kernels: one program per token gathers its K expert rows.

After the grouped expert GEMMs each token's K outputs sit at scattered rows of the
expert-sorted [N = T*K, D] buffer; `inverse[t*K + k]` says where. Three movements
read or write those rows:

  combine forward   out[t]      = sum_k w[t,k] * y[inverse[t*K+k]]        (fp32 sum)
  combine backward  grad_y[n]   = w[t,k] * grad_out[t]   for n = inverse[t*K+k]
                    grad_w[t,k] = <grad_out[t], y[inverse[t*K+k]]>        (fp32)
  dispatch backward grad_x[t]   = sum_k grad_xs[inverse[t*K+k]]           (fp32 sum)

torch.compile turns the same arithmetic (the reference in `glm5/moe.py`) into indirect
loads over [T, K, D] views that run at a quarter of copy bandwidth on an H200; here each
program reads its K row indices once and streams whole rows. The arithmetic and
roundings are the reference's (products and sums in fp32, one rounding to the output
dtype), so results agree to fp32 summation order. The ops are opaque to torch.compile
(`glmtune::moe_*`) and carry their own autograd.

Legend: T tokens, K experts per token, N = T*K routed pairs, D model dim.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_D = 1024


def _gather_sum_kernel(rows_ptr, inverse_ptr, weights_ptr, out_ptr, dim, TOP_K: tl.constexpr,
                       HAS_WEIGHTS: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(inverse_ptr + token * TOP_K + k).to(tl.int64)
        values = tl.load(rows_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            values = values * tl.load(weights_ptr + token * TOP_K + k)
        acc += values
    tl.store(out_ptr + token * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _combine_backward_kernel(grad_ptr, rows_ptr, inverse_ptr, weights_ptr, grad_rows_ptr, grad_weights_ptr, dim,
                             TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_POW2)
    k_ok = ks < TOP_K
    rows = tl.load(inverse_ptr + token * TOP_K + ks, mask=k_ok, other=0).to(tl.int64)
    weights = tl.load(weights_ptr + token * TOP_K + ks, mask=k_ok, other=0.0)
    dots = tl.zeros([K_POW2], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        inside = cols < dim
        grad = tl.load(grad_ptr + token * dim + cols, mask=inside, other=0.0).to(tl.float32)
        both = k_ok[:, None] & inside[None, :]
        offsets = rows[:, None] * dim + cols[None, :]
        values = tl.load(rows_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        dots += tl.sum(values * grad[None, :], axis=1)
        grad_rows = grad[None, :] * weights[:, None]
        tl.store(grad_rows_ptr + offsets, grad_rows.to(grad_rows_ptr.dtype.element_ty), mask=both)
    tl.store(grad_weights_ptr + token * TOP_K + ks, dots, mask=k_ok)


@functools.cache
def _jit(kernel):
    return triton.jit(kernel)  # the CPU interpreter under TRITON_INTERPRET=1


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or device.type == "cpu" and _interpreting())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _gather_sum(rows_ND: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor | None, top_k: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    num_tokens, dim = inverse_N.numel() // top_k, rows_ND.shape[1]
    out = rows_ND.new_empty(num_tokens, dim, dtype=out_dtype)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, BLOCK_D))
        _jit(_gather_sum_kernel)[grid](rows_ND, inverse_N, weights_TK if weights_TK is not None else rows_ND, out,
                                       dim, TOP_K=top_k, HAS_WEIGHTS=weights_TK is not None, BLOCK_D=BLOCK_D)
    return out


@torch.library.custom_op("glmtune::moe_combine", mutates_args=())
def moe_combine(y_ND: torch.Tensor, inverse_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[inverse[t*K + k]], summed in fp32, in y's dtype."""
    return _gather_sum(y_ND.contiguous(), inverse_N.contiguous(), weights_TK.float().contiguous(),
                       weights_TK.shape[1], y_ND.dtype)


@moe_combine.register_fake
def _(y_ND, inverse_N, weights_TK):
    return y_ND.new_empty(weights_TK.shape[0], y_ND.shape[1])


@torch.library.custom_op("glmtune::moe_combine_backward", mutates_args=())
def moe_combine_backward(grad_TD: torch.Tensor, y_ND: torch.Tensor, inverse_N: torch.Tensor,
                         weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, top_k = weights_TK.shape
    grad_y = torch.empty_like(y_ND)
    grad_w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=y_ND.device)
    if num_tokens:
        _jit(_combine_backward_kernel)[(num_tokens,)](
            grad_TD.contiguous(), y_ND.contiguous(), inverse_N.contiguous(), weights_TK.float().contiguous(),
            grad_y, grad_w, y_ND.shape[1], TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_D=BLOCK_D)
    return grad_y, grad_w.to(weights_TK.dtype)


@moe_combine_backward.register_fake
def _(grad_TD, y_ND, inverse_N, weights_TK):
    return torch.empty_like(y_ND), torch.empty_like(weights_TK)


def _combine_setup(ctx, inputs, output):
    y_ND, inverse_N, weights_TK = inputs
    ctx.save_for_backward(y_ND, inverse_N, weights_TK)


def _combine_grad(ctx, grad_TD):
    y_ND, inverse_N, weights_TK = ctx.saved_tensors
    grad_y, grad_w = moe_combine_backward(grad_TD, y_ND, inverse_N, weights_TK)
    return grad_y, None, grad_w


moe_combine.register_autograd(_combine_grad, setup_context=_combine_setup)


@torch.library.custom_op("glmtune::moe_sum_pairs", mutates_args=())
def moe_sum_pairs(rows_ND: torch.Tensor, inverse_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = sum_k rows[inverse[t*K + k]], summed in fp32: the dispatch's backward."""
    return _gather_sum(rows_ND.contiguous(), inverse_N.contiguous(), None, top_k, rows_ND.dtype)


@moe_sum_pairs.register_fake
def _(rows_ND, inverse_N, top_k):
    return rows_ND.new_empty(inverse_N.shape[0] // top_k, rows_ND.shape[1])
