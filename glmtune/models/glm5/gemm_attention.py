"""Masked attention as explicit batched GEMMs, for the DSA top-k part of a row.

Queries past the causal prefix attend an arbitrary top-k subset of their past. Fused
flash kernels take that subset as a dense mask and run it at about half their causal
speed (cuDNN at qk 192+64 / v 256: ~250 TFLOP/s forward, ~190 backward on an H200).
Here the same block of queries is computed as cuBLAS GEMMs around two fused elementwise
passes, with flash attention's roundings:

  forward:  S = q k^T (fp32 out) -> P = softmax(scale S | mask) in bf16, lse in fp32
            -> O = P v
  backward: S and dP = dO v^T recomputed (fp32 out), P and dS = P (dP - rowsum(dO O))
            scale in one pass (both bf16, as flash rounds them for its GEMMs)
            -> dV = P^T dO, dQ = dS k, dK = dS^T q

Nothing quadratic is saved between forward and backward (only O and the fp32 lse), and
heads are processed in groups so that the fp32 score block stays within
`SCORE_ELEMENTS_PER_GROUP`. The op is opaque to torch.compile (`glmtune::gemm_attention`);
its elementwise passes are compiled on CUDA and eager elsewhere. On CPU the fp32-output
GEMMs run in fp32 from upcast inputs (the same values), so the CPU tests exercise the
exact code path against the eager reference.

Legend: B batch, N heads, S queries, T keys, K qk head dim, V value head dim, G = B x N.
"""

from __future__ import annotations

import functools

import torch

SCORE_ELEMENTS_PER_GROUP = 1 << 28  # fp32 scores of one head group: 1 GiB (+ as much for dP in backward)


def _matmul_fp32(a_GMK: torch.Tensor, b_GKN: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> fp32 output (no rounding of the scores to bf16)."""
    if a_GMK.is_cuda:
        return torch.bmm(a_GMK, b_GKN, out_dtype=torch.float32)
    return torch.bmm(a_GMK.float(), b_GKN.float())


def _forward_pass(s_BNST, allowed_B1ST, scale: float, dtype: torch.dtype):
    """P = softmax(scale S | mask) rounded to `dtype`, and the fp32 log-sum-exp per row."""
    logits = torch.where(allowed_B1ST, s_BNST * scale, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # a row with no key: P = 0, no NaN
    probs = torch.where(allowed_B1ST, torch.exp(logits - row_max), 0.0)
    total = probs.sum(dim=-1, keepdim=True)
    lse = row_max + torch.log(total)
    return (probs / torch.where(total == 0, 1.0, total)).to(dtype), lse.squeeze(-1)


def _backward_pass(s_BNST, dp_BNST, lse_BNS, delta_BNS, allowed_B1ST, scale: float, dtype: torch.dtype):
    """P recomputed from the saved lse and dS = P (dP - rowsum(dO O)) scale, both rounded to `dtype`."""
    probs = torch.where(allowed_B1ST, torch.exp(s_BNST * scale - lse_BNS.unsqueeze(-1)), 0.0)
    dscores = probs * (dp_BNST - delta_BNS.unsqueeze(-1)) * scale
    return probs.to(dtype), dscores.to(dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _elementwise(fn, *args):
    # One fused kernel per pass on CUDA instead of eager's several passes over fp32 [B, N, S, T].
    return (_compiled(fn) if args[0].is_cuda else fn)(*args)


def _head_groups(batch: int, heads: int, queries: int, keys: int) -> int:
    per_head = batch * queries * keys
    return max(1, min(heads, SCORE_ELEMENTS_PER_GROUP // max(per_head, 1)))


def _flat(x_BNXY: torch.Tensor, heads: slice) -> torch.Tensor:
    x = x_BNXY[:, heads]
    return x.reshape(-1, x.shape[-2], x.shape[-1])


@torch.library.custom_op("glmtune::gemm_attention", mutates_args=())
def gemm_attention(q_BNSK: torch.Tensor, k_BNTK: torch.Tensor, v_BNTV: torch.Tensor, allowed_BST: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the keys `allowed_BST` marks; returns (out [B, N, S, V], lse [B, N, S] fp32)."""
    batch, heads, queries, _ = q_BNSK.shape
    keys = k_BNTK.shape[2]
    out = q_BNSK.new_empty(batch, heads, queries, v_BNTV.shape[-1])
    lse = q_BNSK.new_empty(batch, heads, queries, dtype=torch.float32)
    allowed_B1ST = allowed_BST.unsqueeze(1)  # broadcast over heads, never copied per head
    step = _head_groups(batch, heads, queries, keys)
    for first in range(0, heads, step):
        group = slice(first, min(first + step, heads))
        n = group.stop - group.start
        s = _matmul_fp32(_flat(q_BNSK, group), _flat(k_BNTK, group).transpose(1, 2)).view(batch, n, queries, keys)
        probs, group_lse = _elementwise(_forward_pass, s, allowed_B1ST, scale, q_BNSK.dtype)
        del s
        out[:, group] = torch.bmm(probs.view(-1, queries, keys), _flat(v_BNTV, group)).view(batch, n, queries, -1)
        lse[:, group] = group_lse
    return out, lse


def attention_outputs_like(q_BNSK, k_BNTK, v_BNTV, allowed_BST, *options):
    """Empty (out [B, N, S, V], lse [B, N, S] fp32): the fake kernel of an attention op returning both."""
    batch, heads, queries, _ = q_BNSK.shape
    return (q_BNSK.new_empty(batch, heads, queries, v_BNTV.shape[-1]),
            q_BNSK.new_empty(batch, heads, queries, dtype=torch.float32))


gemm_attention.register_fake(attention_outputs_like)


@torch.library.custom_op("glmtune::gemm_attention_backward", mutates_args=())
def gemm_attention_backward(grad_out_BNSV: torch.Tensor, q_BNSK: torch.Tensor, k_BNTK: torch.Tensor,
                            v_BNTV: torch.Tensor, out_BNSV: torch.Tensor, lse_BNS: torch.Tensor,
                            allowed_BST: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, queries, _ = q_BNSK.shape
    keys = k_BNTK.shape[2]
    dq, dk, dv = torch.empty_like(q_BNSK), torch.empty_like(k_BNTK), torch.empty_like(v_BNTV)
    delta_BNS = (grad_out_BNSV.float() * out_BNSV.float()).sum(-1)
    allowed_B1ST = allowed_BST.unsqueeze(1)
    step = _head_groups(batch, heads, queries, keys)
    for first in range(0, heads, step):
        group = slice(first, min(first + step, heads))
        n = group.stop - group.start
        q, k, v, d_out = (_flat(t, group) for t in (q_BNSK, k_BNTK, v_BNTV, grad_out_BNSV))
        s = _matmul_fp32(q, k.transpose(1, 2)).view(batch, n, queries, keys)
        dp = _matmul_fp32(d_out, v.transpose(1, 2)).view(batch, n, queries, keys)
        probs, dscores = _elementwise(_backward_pass, s, dp, lse_BNS[:, group], delta_BNS[:, group], allowed_B1ST,
                                      scale, q_BNSK.dtype)
        del s, dp
        probs, dscores = probs.view(-1, queries, keys), dscores.view(-1, queries, keys)
        dv[:, group] = torch.bmm(probs.transpose(1, 2), d_out).view(batch, n, keys, -1)
        dq[:, group] = torch.bmm(dscores, k).view(batch, n, queries, -1)
        dk[:, group] = torch.bmm(dscores.transpose(1, 2), q).view(batch, n, keys, -1)
    return dq, dk, dv


@gemm_attention_backward.register_fake
def _(grad_out_BNSV, q_BNSK, k_BNTK, v_BNTV, out_BNSV, lse_BNS, allowed_BST, scale):
    return torch.empty_like(q_BNSK), torch.empty_like(k_BNTK), torch.empty_like(v_BNTV)


def register_attention_autograd(forward_op, backward_op) -> None:
    """Autograd for an op (q, k, v, allowed, *options) -> (out, lse) whose gradients come from
    `backward_op(grad_out, q, k, v, out, lse, allowed, *options)` (options: non-tensor
    arguments such as the softmax scale): saves exactly those tensors (nothing quadratic
    besides the mask the layer keeps anyway); lse gets no gradient."""

    def setup_context(ctx, inputs, output):
        q, k, v, allowed, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, allowed)
        ctx.options = options

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, allowed = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dq, dk, dv = backward_op(grad_out, q, k, v, out, lse, allowed, *ctx.options)
        return dq, dk, dv, None, *(None for _ in ctx.options)

    forward_op.register_autograd(backward, setup_context=setup_context)


register_attention_autograd(gemm_attention, gemm_attention_backward)


def gemm_masked_attention(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale: float) -> torch.Tensor:
    return gemm_attention(q_BNSK.contiguous(), k_BNTK.contiguous(), v_BNTV.contiguous(), allowed_BST, scale)[0]
