"""Flash attention over an arbitrary boolean key mask (the DSA top-k tail), in Triton.

Past the causal prefix every GLM-5 query attends its own top-k subset of its past. Fused
SDPA kernels take such a subset only as a dense mask or bias and run it at about half
their causal speed. These kernels read the mask as bytes, one [BLOCK_M, BLOCK_N] tile
beside each score tile, shared by every head (the indexer selects per token, not per
head), and skip tiles with no allowed key (other documents of a packed row) from a
per-tile flag computed once per call.

  forward:  online softmax over key tiles (scores in fp32, base-2 exponent), P rounded to
            the input dtype for the PV product; returns O and the fp32 log-sum-exp.
  backward: dQ over key tiles per query tile (which also writes delta = rowsum(dO * O));
            dK and dV over query tiles per key tile (P and dS recomputed from the saved
            lse, rounded like flash attention's).

q, k, v and dO are read through their strides (the last dim contiguous), so the model's
head-split views are never copied; outputs are contiguous. Head dims are padded inside the
kernels to a power of two of at least 64 (masked loads; `_padded` says why).

Queries are the last S of the T keys (query i sits at key T - S + i), so each query tile
stops at its last query's key; the mask decides the rest, causality included. A query
with no allowed key gets O = 0 and lse = +inf (P = 0 in backward, no NaN).

The pure-torch reference is `glmtune.models.glm5.attention.eager_attention`;
`tests/kernels/test_sparse_attention.py` compares them in Triton's CPU interpreter and
`benchmarks/dsa_kernels.py` on the GPU.

Legend: B batch, N heads, S queries, T keys, K qk head dim, V value head dim.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LOG2E = 1.4426950408889634

# Tile sizes and launch options per kernel, from `python benchmarks/dsa_kernels.py --only
# triton_sweep` on an H200 at qk 256 / v 256 (docs/benchmarks.md). dK and dV are separate
# launches: one [BLOCK_N, 256] fp32 accumulator each lets 128-key tiles fit (2.9 ms at seq
# 4096 against 4.8 for both in one launch with 64-key tiles), at the cost of computing the
# scores twice.
FORWARD_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
DQ_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
DK_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
DV_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
# dQ as one cuBLAS GEMM over a bf16 dS that the dK launch writes (it computes dS anyway), and
# dV as one GEMM over its P, instead of the dQ and dV launches recomputing scores, while each
# [B, N, S, T] buffer takes at most this many bytes (`model.attention_score_buffer_mib`).
# Measured on an H200 (docs/benchmarks.md): the tail's backward at seq 4096 (2048 queries x
# 4096 keys, 1 GiB each) takes 3.09 ms this way against 4.73 with the kernels alone, and the
# proxy trains at 24,490 tok/s against 23,668. The default bound keeps the extra memory small:
# a packed 4096 row (2 GiB each; the kernels skip its empty tiles) gains nothing measurable
# (25,899 tok/s against 25,776-26,248 without, +3.3 GiB), and seq 8192 with activation
# checkpointing gains 8% (22,359 against 20,732) for 12 GiB, which a memory-bound run of the
# full model cannot spare; a run that can raises the bound.
SCORE_BUFFER_BYTES = 1 << 30


def _sparse_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, flags_ptr, out_ptr, lse_ptr, scale_log2,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_mb, stride_ms, stride_fb, stride_fm,
    heads, queries, keys,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O and lse of one query tile; out [B, N, S, V] and lse [B, N, S] contiguous."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    dim_k = tl.arange(0, K_PAD)  # head dims padded to powers of two, the padding masked
    dim_v = tl.arange(0, V_PAD)
    k_in = dim_k < HEAD_K
    v_in = dim_v < HEAD_V
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    mask_rows = mask_ptr + b * stride_mb + rows[:, None] * stride_ms
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dim_k[None, :],
                mask=row_ok[:, None] & k_in[None, :], other=0.0)
    run_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    # Keys after the tile's last query are in every one of its queries' future.
    hi = tl.minimum(keys - queries + (pid_m + 1) * BLOCK_M, keys)
    for start in range(0, hi, BLOCK_N):
        if tl.load(flags_ptr + b * stride_fb + pid_m * stride_fm + start // BLOCK_N) != 0:
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < keys
            k = tl.load(k_base + cols[:, None] * stride_kt + dim_k[None, :], mask=col_ok[:, None] & k_in[None, :],
                        other=0.0)
            allowed = tl.load(mask_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(allowed != 0, s, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(s, 1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with no key yet: no inf - inf
            p = tl.exp2(s - base[:, None])
            rescale = tl.exp2(run_max - base)
            run_sum = run_sum * rescale + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vt + dim_v[None, :], mask=col_ok[:, None] & v_in[None, :],
                        other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            run_max = new_max
    empty = run_sum == 0.0
    total = tl.where(empty, 1.0, run_sum)
    stats = bh * queries + rows
    tl.store(out_ptr + stats[:, None] * HEAD_V + dim_v[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & v_in[None, :])
    tl.store(lse_ptr + stats, tl.where(empty, float("inf"), (run_max + tl.log2(total)) / LOG2E_CONST), mask=row_ok)


def _sparse_attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, flags_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, scale, scale_log2,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_mb, stride_ms, stride_fb, stride_fm, stride_db, stride_dh, stride_ds,
    heads, queries, keys,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ of one query tile, and its rows' delta = rowsum(dO * O) for the dK / dV launches.
    out, dq, lse and delta contiguous."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    dim_k = tl.arange(0, K_PAD)  # head dims padded to powers of two, the padding masked
    dim_v = tl.arange(0, V_PAD)
    k_in = dim_k < HEAD_K
    v_in = dim_v < HEAD_V
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    mask_rows = mask_ptr + b * stride_mb + rows[:, None] * stride_ms
    stats = bh * queries + rows
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dim_k[None, :],
                mask=row_ok[:, None] & k_in[None, :], other=0.0)
    d_out = tl.load(do_ptr + b * stride_db + h * stride_dh + rows[:, None] * stride_ds + dim_v[None, :],
                    mask=row_ok[:, None] & v_in[None, :], other=0.0)
    out = tl.load(out_ptr + stats[:, None] * HEAD_V + dim_v[None, :], mask=row_ok[:, None] & v_in[None, :], other=0.0)
    delta = tl.sum(d_out.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(delta_ptr + stats, delta, mask=row_ok)
    lse2 = tl.load(lse_ptr + stats, mask=row_ok, other=float("inf")) * LOG2E_CONST
    dq = tl.zeros([BLOCK_M, K_PAD], dtype=tl.float32)
    hi = tl.minimum(keys - queries + (pid_m + 1) * BLOCK_M, keys)
    for start in range(0, hi, BLOCK_N):
        if tl.load(flags_ptr + b * stride_fb + pid_m * stride_fm + start // BLOCK_N) != 0:
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < keys
            k = tl.load(k_base + cols[:, None] * stride_kt + dim_k[None, :], mask=col_ok[:, None] & k_in[None, :],
                        other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + dim_v[None, :], mask=col_ok[:, None] & v_in[None, :],
                        other=0.0)
            allowed = tl.load(mask_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            p = tl.where(allowed != 0, tl.exp2(s - lse2[:, None]), 0.0)
            dp = tl.dot(d_out, tl.trans(v))
            ds = p * (dp - delta[:, None]) * scale
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + stats[:, None] * HEAD_K + dim_k[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & k_in[None, :])


def _sparse_attention_dkv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, flags_ptr, do_ptr, lse_ptr, delta_ptr, grad_ptr, ds_ptr, p_ptr, scale,
    scale_log2,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_mb, stride_ms, stride_fb, stride_fm, stride_db, stride_dh, stride_ds,
    heads, queries, keys,
    HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, K_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GRAD_K: tl.constexpr, STORE_DS: tl.constexpr, STORE_P: tl.constexpr, FROM_ZERO: tl.constexpr,
):
    """dK (GRAD_K) or dV of one key tile, into a contiguous [B, N, T, *] gradient. With
    STORE_DS / STORE_P (dK only) it also writes its column of dS / P (contiguous [B, N, S, T],
    every element once: zeros where no query sees the key) for dQ = dS K and dV = P^T dO as
    single GEMMs."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < keys
    dim_k = tl.arange(0, K_PAD)  # head dims padded to powers of two, the padding masked
    dim_v = tl.arange(0, V_PAD)
    k_in = dim_k < HEAD_K
    v_in = dim_v < HEAD_V
    q_base = q_ptr + b * stride_qb + h * stride_qh
    do_base = do_ptr + b * stride_db + h * stride_dh
    mask_cols = mask_ptr + b * stride_mb + cols[:, None]
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + cols[:, None] * stride_kt + dim_k[None, :],
                mask=col_ok[:, None] & k_in[None, :], other=0.0)
    if GRAD_K:
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols[:, None] * stride_vt + dim_v[None, :],
                    mask=col_ok[:, None] & v_in[None, :], other=0.0)
        grad = tl.zeros([BLOCK_N, K_PAD], dtype=tl.float32)
    else:
        grad = tl.zeros([BLOCK_N, V_PAD], dtype=tl.float32)
    # Queries before the tile's first key never see it.
    lo = (tl.maximum(pid_n * BLOCK_N - (keys - queries), 0) // BLOCK_M) * BLOCK_M
    ds_cols = ds_ptr + bh * queries * keys + cols[:, None]  # this key tile's columns of dS and P
    p_cols = p_ptr + bh * queries * keys + cols[:, None]
    # Writing dS / P (FROM_ZERO = 1) visits every query tile, storing zeros for the unseen ones.
    for start in range(lo * (1 - FROM_ZERO), queries, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < queries
        tile_ok = row_ok[None, :] & col_ok[:, None]
        flag = tl.load(flags_ptr + b * stride_fb + (start // BLOCK_M) * stride_fm + pid_n)
        if (start >= lo) & (flag != 0):
            stats = bh * queries + rows
            q = tl.load(q_base + rows[:, None] * stride_qs + dim_k[None, :], mask=row_ok[:, None] & k_in[None, :],
                        other=0.0)
            d_out = tl.load(do_base + rows[:, None] * stride_ds + dim_v[None, :],
                            mask=row_ok[:, None] & v_in[None, :], other=0.0)
            lse2 = tl.load(lse_ptr + stats, mask=row_ok, other=float("inf")) * LOG2E_CONST
            allowed_t = tl.load(mask_cols + rows[None, :] * stride_ms, mask=tile_ok, other=0)
            s_t = tl.dot(k, tl.trans(q)) * scale_log2
            p_t = tl.where(allowed_t != 0, tl.exp2(s_t - lse2[None, :]), 0.0)
            if GRAD_K:
                delta = tl.load(delta_ptr + stats, mask=row_ok, other=0.0)
                dp_t = tl.dot(v, tl.trans(d_out))
                ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q.dtype)
                grad += tl.dot(ds_t, q)
                if STORE_DS:
                    tl.store(ds_cols + rows[None, :] * keys, ds_t, mask=tile_ok)
                if STORE_P:
                    tl.store(p_cols + rows[None, :] * keys, p_t.to(p_ptr.dtype.element_ty), mask=tile_ok)
            else:
                grad += tl.dot(p_t.to(d_out.dtype), d_out)
        else:
            if STORE_DS:
                tl.store(ds_cols + rows[None, :] * keys, tl.zeros([BLOCK_N, BLOCK_M], dtype=ds_ptr.dtype.element_ty),
                         mask=tile_ok)
            if STORE_P:
                tl.store(p_cols + rows[None, :] * keys, tl.zeros([BLOCK_N, BLOCK_M], dtype=p_ptr.dtype.element_ty),
                         mask=tile_ok)
    if GRAD_K:
        tl.store(grad_ptr + (bh * keys + cols[:, None]) * HEAD_K + dim_k[None, :], grad.to(grad_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & k_in[None, :])
    else:
        tl.store(grad_ptr + (bh * keys + cols[:, None]) * HEAD_V + dim_v[None, :], grad.to(grad_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & v_in[None, :])


def _attention_delta_kernel(out_ptr, do_ptr, delta_ptr, stride_db, stride_dh, stride_ds, heads, queries,
                            HEAD_V: tl.constexpr, V_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 for one tile of rows (out and delta contiguous)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dim_v = tl.arange(0, V_PAD)
    inside = (rows < queries)[:, None] & (dim_v < HEAD_V)[None, :]
    d_out = tl.load(do_ptr + b * stride_db + h * stride_dh + rows[:, None] * stride_ds + dim_v[None, :],
                    mask=inside, other=0.0)
    out = tl.load(out_ptr + (bh * queries + rows)[:, None] * HEAD_V + dim_v[None, :], mask=inside, other=0.0)
    tl.store(delta_ptr + bh * queries + rows, tl.sum(d_out.to(tl.float32) * out.to(tl.float32), 1),
             mask=rows < queries)


@functools.cache
def _kernel(fn):
    return triton.jit(fn)  # lazily: the CPU interpreter (TRITON_INTERPRET=1) may be switched on first


if triton is not None:
    LOG2E_CONST = tl.constexpr(LOG2E)  # a global the kernels may read: Triton wants it constexpr


def tile_flags(mask_BST: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """uint8 [B, ceil(S / block_m), ceil(T / block_n)]: 1 where the tile has an allowed key."""
    batch, queries, keys = mask_BST.shape
    tiles_m, tiles_n = -(-queries // block_m), -(-keys // block_n)
    mask_bytes = mask_BST.view(torch.uint8)
    if queries % block_m or keys % block_n:
        padded = mask_bytes.new_zeros(batch, tiles_m * block_m, tiles_n * block_n)
        padded[:, :queries, :keys] = mask_bytes
        mask_bytes = padded
    words, per_word = mask_bytes, 1
    if block_n % 8 == 0 and mask_bytes.storage_offset() % 8 == 0 and all(st % 8 == 0 for st in mask_bytes.stride()[:2]):
        # Eight mask bytes as one int64 (each 0 or 1: never negative): an 8x smaller reduction.
        words, per_word = mask_bytes.view(torch.int64), 8
    tiles = words.unflatten(2, (tiles_n, block_n // per_word)).unflatten(1, (tiles_m, block_m)).amax(dim=(2, 4))
    return (tiles != 0).view(torch.uint8)


def _padded(head_dim: int) -> int:
    """A head dim's width inside the kernels: the next power of two, at least 64. With 32
    (the tiny preset's value head dim) Triton 3.6 on an H200 computed a wrong forward (max
    error 1.05 against the eager reference in bf16) and, on the model's strided views, read
    shared memory out of bounds (compute-sanitizer: an illegal memory access); from 64 up
    the outputs and gradients match (docs/benchmarks.md, 2026-12-02). The padding is masked
    on load and store, so only registers are spent."""
    return max(64, triton.next_power_of_2(head_dim))


def _check(q_BNSK, k_BNTK, v_BNTV, mask_BST):
    assert q_BNSK.stride(-1) == k_BNTK.stride(-1) == v_BNTV.stride(-1) == 1
    assert mask_BST.dtype == torch.bool and mask_BST.stride(-1) == 1
    assert mask_BST.shape == (q_BNSK.shape[0], q_BNSK.shape[2], k_BNTK.shape[2]), (mask_BST.shape, q_BNSK.shape)


def _launch(kernel, config, q, k, v, mask_BST, *tensors_and_scales, over_keys: bool = False, d_out_strides=(),
            flags_by_tile: dict | None = None, **constexprs):
    """Launches `kernel` on a grid of (query tiles, or key tiles when `over_keys`) x (B x N),
    with the strides and sizes every kernel takes. `flags_by_tile` shares the tile flags
    between launches of one call that use the same tile shape."""
    batch, heads, queries, head_k = q.shape
    keys, head_v = k.shape[2], v.shape[-1]
    tile = (config["BLOCK_M"], config["BLOCK_N"])
    flags_by_tile = {} if flags_by_tile is None else flags_by_tile
    if tile not in flags_by_tile:
        flags_by_tile[tile] = tile_flags(mask_BST, *tile)
    flags = flags_by_tile[tile]
    tiles = triton.cdiv(keys, config["BLOCK_N"]) if over_keys else triton.cdiv(queries, config["BLOCK_M"])
    _kernel(kernel)[(tiles, batch * heads)](
        q, k, v, mask_BST.view(torch.uint8), flags, *tensors_and_scales,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask_BST.stride(0), mask_BST.stride(1), flags.stride(0), flags.stride(1),
        *d_out_strides, heads, queries, keys, HEAD_K=head_k, HEAD_V=head_v,
        K_PAD=_padded(head_k), V_PAD=_padded(head_v),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"],
        num_stages=config["num_stages"], **constexprs)


def sparse_attention_forward(q_BNSK, k_BNTK, v_BNTV, mask_BST, scale: float):
    """(out [B, N, S, V] in q's dtype, lse [B, N, S] fp32) of q over the keys the mask allows.
    q, k, v may be strided views (last dim contiguous); the outputs are contiguous."""
    _check(q_BNSK, k_BNTK, v_BNTV, mask_BST)
    batch, heads, queries, _ = q_BNSK.shape
    out = q_BNSK.new_empty(batch, heads, queries, v_BNTV.shape[-1])
    lse = q_BNSK.new_empty(batch, heads, queries, dtype=torch.float32)
    _launch(_sparse_attention_forward_kernel, FORWARD_CONFIG, q_BNSK, k_BNTK, v_BNTV, mask_BST,
            out, lse, scale * LOG2E)
    return out, lse


def sparse_attention_backward(grad_out_BNSV, q_BNSK, k_BNTK, v_BNTV, out_BNSV, lse_BNS, mask_BST, scale: float,
                              ds_buffer_bytes: int = SCORE_BUFFER_BYTES, p_buffer_bytes: int = SCORE_BUFFER_BYTES):
    """(dq, dk, dv), contiguous, of `sparse_attention_forward` (whose out and lse these are).

    dQ comes from a materialized dS when [B, N, S, T] fits `ds_buffer_bytes`, dV from a
    materialized P when it fits `p_buffer_bytes`; otherwise from their own kernel launches."""
    _check(q_BNSK, k_BNTK, v_BNTV, mask_BST)
    assert grad_out_BNSV.stride(-1) == 1 and out_BNSV.is_contiguous() and lse_BNS.is_contiguous()
    q, k, v, d_out = q_BNSK, k_BNTK, v_BNTV, grad_out_BNSV
    batch, heads, queries, _ = q.shape
    keys, head_v = k.shape[2], v.shape[-1]
    d_out_strides = (d_out.stride(0), d_out.stride(1), d_out.stride(2))
    delta = torch.empty_like(lse_BNS)
    dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    flags_by_tile = {}  # dK and dV (and dQ, if its tiles match) read the same flags
    common = dict(over_keys=True, d_out_strides=d_out_strides, flags_by_tile=flags_by_tile)
    score_bytes = batch * heads * queries * keys * q.element_size()
    store_ds, store_p = score_bytes <= ds_buffer_bytes, score_bytes <= p_buffer_bytes
    ds = q.new_empty(batch, heads, queries, keys) if store_ds else dk  # (dk: an unused pointer)
    probs = q.new_empty(batch, heads, queries, keys) if store_p else dk
    if store_ds:
        _kernel(_attention_delta_kernel)[(triton.cdiv(queries, 64), batch * heads)](
            out_BNSV, d_out, delta, *d_out_strides, heads, queries, HEAD_V=head_v,
            V_PAD=_padded(head_v), BLOCK_M=64)
    else:  # the dQ kernel writes delta for the dK launch
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _launch(_sparse_attention_dq_kernel, DQ_CONFIG, q, k, v, mask_BST, out_BNSV, d_out, lse_BNS, delta, dq,
                scale, scale * LOG2E, d_out_strides=d_out_strides, flags_by_tile=flags_by_tile)
    _launch(_sparse_attention_dkv_kernel, DK_CONFIG, q, k, v, mask_BST, d_out, lse_BNS, delta, dk, ds, probs,
            scale, scale * LOG2E, GRAD_K=True, STORE_DS=store_ds, STORE_P=store_p, FROM_ZERO=int(store_ds or store_p),
            **common)
    if store_ds:
        dq = torch.matmul(ds, k)
        del ds
    if store_p:
        torch.matmul(probs.transpose(-1, -2), d_out, out=dv)
        del probs
    else:
        _launch(_sparse_attention_dkv_kernel, DV_CONFIG, q, k, v, mask_BST, d_out, lse_BNS, delta, dv, dv, dv,
                scale, scale * LOG2E, GRAD_K=False, STORE_DS=False, STORE_P=False, FROM_ZERO=0, **common)
    return dq, dk, dv
