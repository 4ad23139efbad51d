"""AdamW update as one Triton kernel per parameter tensor, at memory bandwidth.

The step is bound by bytes: per bf16 parameter it reads p, g, m, v and writes p, m, v
(14 bytes). torch's fused AdamW (multi-tensor apply over 64K-element chunks) moves them
at ~60% of an H200's copy bandwidth on the GLM-5 proxy; a flat elementwise kernel per
tensor with large blocks gets close to copy speed. The arithmetic is torch's fused
AdamW's, in fp32, states stored in their own dtype:

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g * g
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

`glmtune.train.optim.TritonAdamW` drives it; `tests/kernels/test_adamw.py` checks it
against `torch.optim.AdamW` (on CPU in Triton's interpreter).

`adamw_master_step_` is the same update of an fp32 master copy w of a low-precision
parameter p (fp32 master weights held by the optimizer, `glmtune.train.master_adamw`):
it reads g (bf16), w, m, v (fp32) and writes w, m, v and p = bf16(w): 28 bytes per
parameter, the least that moving every weight at lr 1e-5 in bf16 compute can cost.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096


def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, numel, decay_factor, beta1, beta2, step_size, inv_sqrt_bias2, eps,
            BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    p = tl.load(p_ptr + offs, mask=inside).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=inside).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=inside).to(tl.float32)
    p = p * decay_factor
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) * inv_sqrt_bias2 + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=inside)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=inside)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=inside)


def _adamw_master_kernel(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, numel, decay_factor, beta1, beta2, step_size,
                         inv_sqrt_bias2, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    g = tl.load(g_ptr + offs, mask=inside).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=inside)
    m = tl.load(m_ptr + offs, mask=inside)
    v = tl.load(v_ptr + offs, mask=inside)
    w = w * decay_factor
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) * inv_sqrt_bias2 + eps
    w = w - step_size * (m / denom)
    tl.store(w_ptr + offs, w, mask=inside)
    tl.store(m_ptr + offs, m, mask=inside)
    tl.store(v_ptr + offs, v, mask=inside)
    tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _compiled():
    return triton.jit(_adamw_kernel)  # the CPU interpreter under TRITON_INTERPRET=1


@functools.cache
def _compiled_master():
    return triton.jit(_adamw_master_kernel)


def _check_device(param: torch.Tensor) -> None:
    if param.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError("the triton AdamW runs on CUDA (on CPU only under TRITON_INTERPRET=1)")
    if param.dtype == torch.bfloat16 and param.device.type == "cpu":
        raise ValueError("Triton's CPU interpreter has no bf16; check the kernel with fp32/fp16 tensors")


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of a contiguous tensor and its states, in place. `step` counts from 1."""
    assert param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()
    assert param.numel() == grad.numel() == exp_avg.numel() == exp_avg_sq.numel()
    if param.numel() == 0:
        return
    _check_device(param)
    step_size = lr / (1.0 - beta1**step)
    inv_sqrt_bias2 = 1.0 / math.sqrt(1.0 - beta2**step)
    grid = (triton.cdiv(param.numel(), BLOCK),)
    _compiled()[grid](param, grad, exp_avg, exp_avg_sq, param.numel(), 1.0 - lr * weight_decay, beta1, beta2,
                      step_size, inv_sqrt_bias2, eps, BLOCK=BLOCK,
                      **({"num_warps": 8} if param.is_cuda else {}))


def adamw_master_step_(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float) -> None:
    """One AdamW update of the fp32 `master` of `param` and its fp32 moments, in place; `param`
    gets the master rounded to its own dtype. Contiguous tensors of one size; `step` from 1."""
    tensors = (param, grad, master, exp_avg, exp_avg_sq)
    assert all(t.is_contiguous() and t.numel() == param.numel() for t in tensors)
    assert master.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32
    if param.numel() == 0:
        return
    _check_device(param)
    grid = (triton.cdiv(param.numel(), BLOCK),)
    _compiled_master()[grid](param, grad, master, exp_avg, exp_avg_sq, param.numel(), 1.0 - lr * weight_decay,
                             beta1, beta2, lr / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step), eps,
                             BLOCK=BLOCK, **({"num_warps": 8} if param.is_cuda else {}))


def available() -> bool:
    return triton is not None
