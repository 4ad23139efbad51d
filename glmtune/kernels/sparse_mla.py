"""Sparse MLA attention in its absorbed (MQA) form, fused in Triton: each query gathers its own keys.

DSA's indexer selects keys per token, not per head, and in MLA's absorbed form every head's key
is the token's compressed KV c = [latent (R) | roped k_rot (E)] and its value is the latent. So
a program takes one query token and a group of its heads as the rows of its tiles: the keys it
gathers by index (through their row numbers, on chip) serve all those rows, and nothing of size
[queries, top-k, C] is ever written to memory.

  forward:  per (query, head group), over the query's slots in tiles of BLOCK_N: gather the
            keys, S = q_lat c_lat^T + q_rot c_rot^T (fp32), online softmax in base 2, P rounded
            to the input dtype for O += P c_lat. O and the fp32 log-sum-exp out.
  backward: (1) per (query, head group): S and dP = dO c_lat^T recomputed, P from the saved lse,
            dS = P (dP - delta) scale, both rounded to the input dtype as flash rounds them for
            its GEMMs; dQ = dS c accumulated in fp32; P and dS written to [rows, N, K] buffers.
            (2) per (query, slot tile): the gathered keys' gradient dS^T q (+ P^T dO on the
            latent part), one [BLOCK_N, N] x [N, BLOCK_C] product per column tile over all
            heads, added into an fp32 dC with atomics: queries share keys, and the atomics are
            the sum over the queries that selected a key.
            The buffers take at most `buffer_bytes` each: queries are processed in chunks.

Layouts: the queries' latent and rope parts q_lat [M, N, R], q_rot [M, N, E] and the output's
gradient [M, N, R] (unit column stride; queries and heads by their strides: an einsum's head-major
output needs no copy), the keys' c_lat [B, T, R], c_rot [B, T, E] (unit column stride, rows by
their strides: the two halves of one [B, T, C] tensor need no copy), index int64 [M, K] (each
slot's key within its query's batch row), valid bool [M, K]; out [M, N, R], lse [M, N]. Taking
the parts apart saves the callers the concatenations [q_nope W_uk | q_rot] and [latent | k_rot]
and the split of their gradients. A query loops over its slots up to its last valid one
(`slot_ends`); a query without one gets O = 0, lse = -inf.

The pure-torch reference is `glmtune.models.glm5.absorbed_attention` (the same op over gathered
key blocks); tests/kernels/test_sparse_mla.py compares both with a float64 softmax in Triton's
CPU interpreter, `benchmarks/dsa_kernels.py --only absorbed` on the GPU.

Legend: B batch, S queries per row, T keys per row, M = B x S queries, N heads, K slots (top-k),
R latent rank (the values), E rope dim, C = R + E.
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

# Tile sizes and launch options, from `benchmarks/sparse_mla_sweep.py` on an H100 (a cp-8 rank's
# 4096 queries of a 32K row, top-2048, 64 heads, R 512, E 64: docs/benchmarks.md). BLOCK_H heads of
# one query are a tile's rows (tl.dot needs at least 16): the more heads share a gathered key tile,
# the less gathering — the forward with all 64 took 3.7 ms against 7.9 with 32 and 10.3 with 16.
# The dQ kernel accumulates [BLOCK_H, C] in fp32, so 32 (24.7 ms for the backward against 29.1 with
# 16); the key-gradient kernel's 128-slot tiles halve its loads of q and dO per slot.
FORWARD_CONFIG = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
DQ_CONFIG = {"BLOCK_H": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
DKV_CONFIG = {"BLOCK_N": 128, "BLOCK_C": 64, "num_warps": 4, "num_stages": 1}
BUFFER_BYTES = 1 << 30  # each of the backward's P and dS buffers
SELECT_BLOCK = 1024  # keys per tile of `selected_keys`' pass over a query's mask row


def _sparse_mla_forward_kernel(
    q_lat_ptr, q_rot_ptr, c_lat_ptr, c_rot_ptr, index_ptr, valid_ptr, ends_ptr, out_ptr, lse_ptr, scale_log2,
    queries, heads, slots, q_lat_sm, q_lat_sh, q_rot_sm, q_rot_sh, c_lat_sb, c_lat_st, c_rot_sb, c_rot_st,
    R: tl.constexpr, E: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O [BLOCK_H, R] and lse of one query's head group."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < heads
    dim_r, dim_e = tl.arange(0, R_PAD), tl.arange(0, E_PAD)
    r_in, e_in = dim_r < R, dim_e < E
    stats = row * heads + head
    q_lat = tl.load(q_lat_ptr + row * q_lat_sm + head[:, None] * q_lat_sh + dim_r[None, :],
                    mask=head_ok[:, None] & r_in[None, :], other=0.0)
    q_rot = tl.load(q_rot_ptr + row * q_rot_sm + head[:, None] * q_rot_sh + dim_e[None, :],
                    mask=head_ok[:, None] & e_in[None, :], other=0.0)
    batch = row // queries
    end = tl.load(ends_ptr + row)
    run_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        in_range = slot < end
        ok = tl.load(valid_ptr + row * slots + slot, mask=in_range, other=0) != 0
        key = tl.load(index_ptr + row * slots + slot, mask=in_range, other=0)
        k_lat = tl.load((c_lat_ptr + batch * c_lat_sb + key * c_lat_st)[:, None] + dim_r[None, :],
                        mask=ok[:, None] & r_in[None, :], other=0.0)
        k_rot = tl.load((c_rot_ptr + batch * c_rot_sb + key * c_rot_st)[:, None] + dim_e[None, :],
                        mask=ok[:, None] & e_in[None, :], other=0.0)
        s = (tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rot, tl.trans(k_rot))) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, 1))
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: no inf - inf
        p = tl.exp2(s - base[:, None])
        rescale = tl.exp2(run_max - base)
        run_sum = run_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        run_max = new_max
    empty = run_sum == 0.0
    total = tl.where(empty, 1.0, run_sum)
    tl.store(out_ptr + stats[:, None] * R + dim_r[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & r_in[None, :])
    lse = tl.where(empty, float("-inf"), (run_max + tl.log2(total)) / LOG2E_CONST)
    tl.store(lse_ptr + stats, lse, mask=head_ok)


def _sparse_mla_dq_kernel(
    q_lat_ptr, q_rot_ptr, c_lat_ptr, c_rot_ptr, index_ptr, valid_ptr, ends_ptr, do_ptr, lse_ptr, delta_ptr,
    dq_lat_ptr, dq_rot_ptr, ds_ptr, p_ptr, scale, scale_log2, first_row, queries, heads, slots,
    q_lat_sm, q_lat_sh, q_rot_sm, q_rot_sh, do_sm, do_sh, c_lat_sb, c_lat_st, c_rot_sb, c_rot_st,
    R: tl.constexpr, E: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ [BLOCK_H, C] (latent and rope parts) of one query's head group; its P and dS into the chunk's buffers."""
    local = tl.program_id(0).to(tl.int64)
    row = first_row + local
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = head < heads
    dim_r, dim_e = tl.arange(0, R_PAD), tl.arange(0, E_PAD)
    r_in, e_in = dim_r < R, dim_e < E
    stats = row * heads + head
    lat_at = stats[:, None] * R + dim_r[None, :]
    rot_at = stats[:, None] * E + dim_e[None, :]
    lat_ok, rot_ok = head_ok[:, None] & r_in[None, :], head_ok[:, None] & e_in[None, :]
    q_lat = tl.load(q_lat_ptr + row * q_lat_sm + head[:, None] * q_lat_sh + dim_r[None, :], mask=lat_ok, other=0.0)
    q_rot = tl.load(q_rot_ptr + row * q_rot_sm + head[:, None] * q_rot_sh + dim_e[None, :], mask=rot_ok, other=0.0)
    d_out = tl.load(do_ptr + row * do_sm + head[:, None] * do_sh + dim_r[None, :], mask=lat_ok, other=0.0)
    lse2 = tl.load(lse_ptr + stats, mask=head_ok, other=0.0) * LOG2E_CONST
    delta = tl.load(delta_ptr + stats, mask=head_ok, other=0.0)
    buffer_rows = (local * heads + head) * slots
    batch = row // queries
    end = tl.load(ends_ptr + row)
    dq_lat = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    dq_rot = tl.zeros([BLOCK_H, E_PAD], dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        in_range = slot < end
        ok = tl.load(valid_ptr + row * slots + slot, mask=in_range, other=0) != 0
        key = tl.load(index_ptr + row * slots + slot, mask=in_range, other=0)
        k_lat = tl.load((c_lat_ptr + batch * c_lat_sb + key * c_lat_st)[:, None] + dim_r[None, :],
                        mask=ok[:, None] & r_in[None, :], other=0.0)
        k_rot = tl.load((c_rot_ptr + batch * c_rot_sb + key * c_rot_st)[:, None] + dim_e[None, :],
                        mask=ok[:, None] & e_in[None, :], other=0.0)
        s = (tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rot, tl.trans(k_rot))) * scale_log2
        p = tl.where(ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(d_out, tl.trans(k_lat))
        ds = (p * (dp - delta[:, None]) * scale).to(k_lat.dtype)
        dq_lat += tl.dot(ds, k_lat)
        dq_rot += tl.dot(ds, k_rot)
        written = head_ok[:, None] & in_range[None, :]
        tl.store(ds_ptr + buffer_rows[:, None] + slot[None, :], ds, mask=written)
        tl.store(p_ptr + buffer_rows[:, None] + slot[None, :], p.to(k_lat.dtype), mask=written)
    tl.store(dq_lat_ptr + lat_at, dq_lat.to(dq_lat_ptr.dtype.element_ty), mask=lat_ok)
    tl.store(dq_rot_ptr + rot_at, dq_rot.to(dq_rot_ptr.dtype.element_ty), mask=rot_ok)


def _sparse_mla_dkv_kernel(
    q_lat_ptr, q_rot_ptr, index_ptr, valid_ptr, ends_ptr, do_ptr, ds_ptr, p_ptr, dc_lat_ptr, dc_rot_ptr,
    first_row, queries, keys, heads, slots, q_lat_sm, q_lat_sh, q_rot_sm, q_rot_sh, do_sm, do_sh,
    R: tl.constexpr, E: tl.constexpr, N_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The gradient of one query's slot tile's keys, dS^T q (+ P^T dO on the latent), added into dC."""
    local = tl.program_id(0).to(tl.int64)
    row = first_row + local
    start = tl.program_id(1) * BLOCK_N
    end = tl.load(ends_ptr + row)
    if start < end:
        slot = start + tl.arange(0, BLOCK_N)
        in_range = slot < end
        ok = tl.load(valid_ptr + row * slots + slot, mask=in_range, other=0) != 0
        key_row = (row // queries) * keys + tl.load(index_ptr + row * slots + slot, mask=in_range, other=0)
        head = tl.arange(0, N_PAD)
        head_ok = head < heads
        buffer = ((local * heads + head) * slots)[:, None] + slot[None, :]
        ds = tl.load(ds_ptr + buffer, mask=head_ok[:, None] & in_range[None, :], other=0.0)  # [N_PAD, BLOCK_N]
        p = tl.load(p_ptr + buffer, mask=head_ok[:, None] & in_range[None, :], other=0.0)
        q_lat_rows = q_lat_ptr + row * q_lat_sm + head[:, None] * q_lat_sh
        do_rows = do_ptr + row * do_sm + head[:, None] * do_sh
        q_rot_rows = q_rot_ptr + row * q_rot_sm + head[:, None] * q_rot_sh
        for first_col in range(0, R, BLOCK_C):  # the latent: key and value
            col = first_col + tl.arange(0, BLOCK_C)
            col_ok = head_ok[:, None] & (col < R)[None, :]
            q_cols = tl.load(q_lat_rows + col[None, :], mask=col_ok, other=0.0)
            d_out = tl.load(do_rows + col[None, :], mask=col_ok, other=0.0)
            grad = tl.dot(tl.trans(ds), q_cols) + tl.dot(tl.trans(p), d_out)  # [BLOCK_N, BLOCK_C] fp32
            tl.atomic_add(dc_lat_ptr + key_row[:, None] * R + col[None, :], grad,
                          mask=ok[:, None] & (col < R)[None, :], sem="relaxed")
        for first_col in range(0, E, BLOCK_C):  # the rope part: key only
            col = first_col + tl.arange(0, BLOCK_C)
            q_cols = tl.load(q_rot_rows + col[None, :], mask=head_ok[:, None] & (col < E)[None, :], other=0.0)
            tl.atomic_add(dc_rot_ptr + key_row[:, None] * E + col[None, :], tl.dot(tl.trans(ds), q_cols),
                          mask=ok[:, None] & (col < E)[None, :], sem="relaxed")


def _selected_keys_kernel(mask_ptr, index_ptr, count_ptr, queries, keys, slots, stride_mb, stride_ms,
                          BLOCK_T: tl.constexpr):
    """One query's selected keys, ascending, into its first slots (a running count over key tiles)."""
    row = tl.program_id(0).to(tl.int64)
    mask_row = mask_ptr + (row // queries) * stride_mb + (row % queries) * stride_ms
    total = tl.zeros([], dtype=tl.int32)
    for start in range(0, keys, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        chosen = tl.load(mask_row + cols, mask=cols < keys, other=0).to(tl.int32)
        slot = total + tl.cumsum(chosen, 0) - 1
        tl.store(index_ptr + row * slots + slot, cols.to(tl.int64), mask=(chosen != 0) & (slot < slots))
        total += tl.sum(chosen, 0)
    tl.store(count_ptr + row, total)


@functools.cache
def _kernel(fn):
    return triton.jit(fn)  # lazily: the CPU interpreter (TRITON_INTERPRET=1) may be switched on first


if triton is not None:
    LOG2E_CONST = tl.constexpr(LOG2E)  # a global the kernels may read: Triton wants it constexpr


def _padded(dim: int) -> int:
    """A width inside the kernels: the next power of two, at least 64. tl.dot needs 16; the masked
    flash kernels found Triton 3.6 wrong on an H200 with a 32-wide reduction (`sparse_attention._padded`),
    so no reduction here is narrower than the widths measured right. GLM-5's (R 512, E 64, 64 heads)
    are unchanged; the padding is masked on load and store."""
    return max(64, triton.next_power_of_2(dim))


def slot_ends(valid_MK: torch.Tensor) -> torch.Tensor:
    """int32 [M]: one past each query's last valid slot (0 for a query with none)."""
    numbers = torch.arange(1, valid_MK.shape[-1] + 1, dtype=torch.int32, device=valid_MK.device)
    return torch.where(valid_MK, numbers, 0).amax(-1).to(torch.int32)


def selected_keys(mask_BST: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int64 [B, S, K], valid bool [B, S, K]) of a selection mask (last dim contiguous): each
    query's selected keys in ascending order in its first slots, key 0 in the rest, as
    `glmtune.models.glm5.absorbed_attention.selected_keys` computes them in torch (its reference).
    One pass over the mask instead of the reference's cumsum and scatter over [S, T] int64 blocks. A
    query selecting more than K keys fails a device-side assert (never a silent drop)."""
    assert mask_BST.dtype == torch.bool and mask_BST.stride(-1) == 1
    batch, queries, keys = mask_BST.shape
    index = torch.zeros(batch, queries, slots, dtype=torch.int64, device=mask_BST.device)
    count = torch.empty(batch, queries, dtype=torch.int32, device=mask_BST.device)
    if batch * queries:
        _kernel(_selected_keys_kernel)[(batch * queries,)](
            mask_BST.view(torch.uint8), index, count, queries, keys, slots, mask_BST.stride(0), mask_BST.stride(1),
            BLOCK_T=SELECT_BLOCK, num_warps=4)
        torch._assert_async(count.max() <= slots, "a query selects more keys than its slots")
    valid = torch.arange(slots, device=mask_BST.device) < count.unsqueeze(-1)
    return index, valid


def _check(q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK, queries: int):
    # Strided views (a row's [latent | rope] halves, an einsum's head-major output): rows and heads by
    # their strides, columns unit.
    assert q_lat_MNR.stride(-1) == 1 and q_rot_MNE.stride(-1) == 1 and q_lat_MNR.shape[:2] == q_rot_MNE.shape[:2]
    assert c_lat_BTR.stride(-1) == 1 and c_rot_BTE.stride(-1) == 1 and c_lat_BTR.shape[:2] == c_rot_BTE.shape[:2]
    assert q_lat_MNR.shape[-1] == c_lat_BTR.shape[-1] and q_rot_MNE.shape[-1] == c_rot_BTE.shape[-1]
    assert index_MK.is_contiguous() and valid_MK.is_contiguous()
    assert index_MK.dtype == torch.int64 and valid_MK.dtype == torch.bool
    assert index_MK.shape == valid_MK.shape and index_MK.shape[0] == q_lat_MNR.shape[0] and index_MK.shape[-1] > 0
    assert q_lat_MNR.shape[0] == c_lat_BTR.shape[0] * queries, "every batch row's queries"


def _row_strides(**tensors) -> dict:
    """The kernels' stride arguments: NAME_sm / NAME_sh (query, head) of the [M, N, ·] tensors named
    q_* or do, NAME_sb / NAME_st (batch row, key) of the [B, T, ·] ones named c_*."""
    axes = {"q": ("sm", "sh"), "d": ("sm", "sh"), "c": ("sb", "st")}
    return {f"{name}_{axis}": t.stride(i) for name, t in tensors.items() for i, axis in enumerate(axes[name[0]])}


def _widths(q_lat_MNR, q_rot_MNE) -> dict:
    latent, rope = q_lat_MNR.shape[-1], q_rot_MNE.shape[-1]
    return dict(R=latent, E=rope, R_PAD=_padded(latent), E_PAD=_padded(rope))


def sparse_mla_forward(q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK, queries: int, scale: float):
    """(out [M, N, R] in q's dtype, lse [M, N] fp32): each query over its valid slots' keys, whose
    scores are q_lat c_lat^T + q_rot c_rot^T and whose values are c_lat. Query m belongs to batch
    row m // `queries`, whose keys are c_lat[b], c_rot[b]."""
    _check(q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK, queries)
    rows, heads, latent = q_lat_MNR.shape
    out = q_lat_MNR.new_empty(rows, heads, latent)
    lse = q_lat_MNR.new_empty(rows, heads, dtype=torch.float32)
    config = FORWARD_CONFIG
    if rows == 0:
        return out, lse
    block_h = min(config["BLOCK_H"], _padded(heads))
    _kernel(_sparse_mla_forward_kernel)[(rows, triton.cdiv(heads, block_h))](
        q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK.view(torch.uint8), slot_ends(valid_MK), out,
        lse, scale * LOG2E, queries, heads, index_MK.shape[-1],
        **_row_strides(q_lat=q_lat_MNR, q_rot=q_rot_MNE, c_lat=c_lat_BTR, c_rot=c_rot_BTE),
        **_widths(q_lat_MNR, q_rot_MNE), BLOCK_H=block_h, BLOCK_N=config["BLOCK_N"],
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out, lse


def sparse_mla_backward(grad_out_MNR, q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK, out_MNR,
                        lse_MN, queries: int, scale: float, buffer_bytes: int = BUFFER_BYTES):
    """(dq_lat [M, N, R], dq_rot [M, N, E] in q's dtype, dc_lat [B, T, R], dc_rot [B, T, E] in c's
    dtype) of `sparse_mla_forward`, whose out and lse these are. P and dS live in buffers of at most
    `buffer_bytes` each (at least one query)."""
    _check(q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid_MK, queries)
    assert grad_out_MNR.stride(-1) == 1 and out_MNR.is_contiguous() and lse_MN.is_contiguous()
    rows, heads, latent = q_lat_MNR.shape
    batch, keys, rope = c_rot_BTE.shape
    slots = index_MK.shape[-1]
    ends = slot_ends(valid_MK)
    valid = valid_MK.view(torch.uint8)
    delta = (grad_out_MNR.float() * out_MNR.float()).sum(-1)  # rowsum(dO * O) [M, N]
    dq_lat, dq_rot = q_lat_MNR.new_empty(q_lat_MNR.shape), q_rot_MNE.new_empty(q_rot_MNE.shape)  # contiguous
    # fp32 sums of the atomics, one per part (contiguous: the kernel adds at row x key width)
    dc_lat = torch.zeros(batch, keys, latent, dtype=torch.float32, device=c_lat_BTR.device)
    dc_rot = torch.zeros(batch, keys, rope, dtype=torch.float32, device=c_rot_BTE.device)
    chunk = max(1, buffer_bytes // max(1, heads * slots * q_lat_MNR.element_size()))
    ds = q_lat_MNR.new_empty(min(chunk, rows), heads, slots)
    probs = torch.empty_like(ds)
    dq_config, dkv_config = DQ_CONFIG, DKV_CONFIG
    block_h = min(dq_config["BLOCK_H"], _padded(heads))
    for first in range(0, rows, chunk):
        count = min(chunk, rows - first)
        _kernel(_sparse_mla_dq_kernel)[(count, triton.cdiv(heads, block_h))](
            q_lat_MNR, q_rot_MNE, c_lat_BTR, c_rot_BTE, index_MK, valid, ends, grad_out_MNR, lse_MN, delta, dq_lat,
            dq_rot, ds, probs, scale, scale * LOG2E, first, queries, heads, slots,
            **_row_strides(q_lat=q_lat_MNR, q_rot=q_rot_MNE, do=grad_out_MNR, c_lat=c_lat_BTR, c_rot=c_rot_BTE),
            **_widths(q_lat_MNR, q_rot_MNE), BLOCK_H=block_h, BLOCK_N=dq_config["BLOCK_N"],
            num_warps=dq_config["num_warps"], num_stages=dq_config["num_stages"])
        _kernel(_sparse_mla_dkv_kernel)[(count, triton.cdiv(slots, dkv_config["BLOCK_N"]))](
            q_lat_MNR, q_rot_MNE, index_MK, valid, ends, grad_out_MNR, ds, probs, dc_lat, dc_rot, first, queries,
            keys, heads, slots, **_row_strides(q_lat=q_lat_MNR, q_rot=q_rot_MNE, do=grad_out_MNR), R=latent, E=rope,
            N_PAD=_padded(heads), BLOCK_N=dkv_config["BLOCK_N"], BLOCK_C=dkv_config["BLOCK_C"],
            num_warps=dkv_config["num_warps"], num_stages=dkv_config["num_stages"])
    return dq_lat, dq_rot, dc_lat.to(c_lat_BTR.dtype), dc_rot.to(c_rot_BTE.dtype)
