"""Fused DSA indexer scores: one Triton kernel instead of a [S, H, T] fp32 tensor.

    scores[b, s, t] = sum_h w[b, s, h] * ReLU(scale * q[b, s, h, :] . k[b, t, :])

The pure-torch reference (`glmtune.models.glm5.indexer.Indexer.combine`) upcasts the
bf16 q and k to fp32, writes every per-head score [B, S, H, T] to memory, then reduces
over heads with a batched GEMV. Here a program owns a [BLOCK_S, BLOCK_T] tile, loops
over the heads with one tensor-core dot each (bf16 products are exact in fp32, so the
only difference from the reference is fp32 accumulation order) and keeps the head sum
in registers: per-head scores never reach memory.

With `causal_offset` set, tiles whose keys all lie in the future of every query of the
tile (key > query + offset) are skipped and left as zeros: the caller masks them away
before top-k anyway, so only work is saved.

On CUDA the kernel is compiled; on CPU it runs only in Triton's interpreter
(TRITON_INTERPRET=1), which is how the CPU test suite checks it against the reference.

Legend: B batch, S queries, T keys, H indexer heads, D head dim.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the torch reference backends remain
    triton = None


def available() -> bool:
    return triton is not None


def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, seq_q, seq_k, num_heads, head_dim, scale, causal_offset,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_kt, stride_wb, stride_ws, stride_ob, stride_os,
            CAUSAL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # int64 offsets: batch x S x H x D elements can pass 2^31 at long context
    pid_s = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_S, BLOCK_T), dtype=tl.float32)
    last_query = pid_s * BLOCK_S + BLOCK_S - 1 + causal_offset
    if (not CAUSAL) or (pid_t * BLOCK_T <= last_query):
        k_tile = tl.load(k_ptr + b * stride_kb + offs_t[None, :] * stride_kt + offs_d[:, None],
                         mask=(offs_t[None, :] < seq_k) & (offs_d[:, None] < head_dim), other=0.0)
        q_base = q_ptr + b * stride_qb + offs_s[:, None] * stride_qs + offs_d[None, :]
        q_mask = (offs_s[:, None] < seq_q) & (offs_d[None, :] < head_dim)
        w_base = w_ptr + b * stride_wb + offs_s * stride_ws
        for h in range(0, num_heads):
            q_tile = tl.load(q_base + h * stride_qh, mask=q_mask, other=0.0)
            dots = tl.dot(q_tile, k_tile)  # fp32 accumulation of exact bf16 products
            w_h = tl.load(w_base + h, mask=offs_s < seq_q, other=0.0)
            acc += tl.maximum(dots * scale, 0.0) * w_h[:, None]
    out = out_ptr + b * stride_ob + offs_s[:, None] * stride_os + offs_t[None, :]
    tl.store(out, acc, mask=(offs_s[:, None] < seq_q) & (offs_t[None, :] < seq_k))


@functools.cache
def _compiled():
    # TRITON_INTERPRET=1 (read by triton at import) makes this the CPU interpreter.
    return triton.jit(_indexer_scores_kernel)


def indexer_scores(q_BSHD: torch.Tensor, k_BTD: torch.Tensor, w_BSH: torch.Tensor, scale: float,
                   causal_offset: int | None = None) -> torch.Tensor:
    """fp32 scores [B, S, T]. q, k: the model dtype (bf16/fp16/fp32); w: fp32 head weights.

    `causal_offset`: query i sits at key position i + offset; tiles wholly in the future
    of their queries are left zero (to be masked by the caller). None computes every tile.
    """
    if triton is None:
        raise ValueError("the fused indexer backend needs the `triton` package (pip install triton)")
    batch, seq_q, num_heads, head_dim = q_BSHD.shape
    seq_k = k_BTD.shape[1]
    assert k_BTD.shape == (batch, seq_k, head_dim) and w_BSH.shape == (batch, seq_q, num_heads)
    q_BSHD = q_BSHD if q_BSHD.stride(-1) == 1 else q_BSHD.contiguous()
    k_BTD = k_BTD.to(q_BSHD.dtype)
    k_BTD = k_BTD if k_BTD.stride(-1) == 1 else k_BTD.contiguous()
    w_BSH = w_BSH.float().contiguous()
    out = torch.empty(batch, seq_q, seq_k, dtype=torch.float32, device=q_BSHD.device)
    block_s, block_t = (64, 128) if q_BSHD.is_cuda else (16, 16)
    grid = (triton.cdiv(seq_q, block_s), triton.cdiv(seq_k, block_t), batch)
    if not q_BSHD.is_cuda:
        if not triton.knobs.runtime.interpret:
            raise ValueError("the fused indexer backend runs on CUDA (on CPU only under TRITON_INTERPRET=1)")
        # numpy has no bf16: widen (exactly) for Triton's CPU interpreter
        q_BSHD, k_BTD = q_BSHD.float(), k_BTD.float()
    _compiled()[grid](q_BSHD, k_BTD, w_BSH, out, seq_q, seq_k, num_heads, head_dim, float(scale),
                      0 if causal_offset is None else int(causal_offset),
                      q_BSHD.stride(0), q_BSHD.stride(1), q_BSHD.stride(2), k_BTD.stride(0), k_BTD.stride(1),
                      w_BSH.stride(0), w_BSH.stride(1), out.stride(0), out.stride(1),
                      CAUSAL=causal_offset is not None, BLOCK_S=block_s, BLOCK_T=block_t,
                      BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                      **({"num_warps": 8, "num_stages": 2} if q_BSHD.is_cuda else {}))
    return out
