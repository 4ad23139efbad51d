"""MLA in its absorbed (MQA) form over each query's selected keys only, as DeepSeek-V3.2 trains DSA.

The other backends expand every key through kv_b (N heads x (nope + v) per key) and attend
the whole causal past with the top-k selection as a dense mask. Here kv_b is folded into
the queries and outputs (`MLAttention._absorbed_attend`): each head's query is
[q_nope W_uk | q_rope] (C = R + rope wide), every head shares the key c = [latent | k_rot]
and the value latent (the first R of c), and the output latent goes through W_uv. This
module holds the sparse attention between them:

  `selected_keys`:       the selection mask [B, S, T] -> per query the indices of its keys,
                         ascending, in K slots, and which slots hold one (a query with fewer
                         than K keys leaves the rest invalid: they point at key 0, masked).
  `absorbed_attention`:  per block of queries, gather their keys [Sb, K, C] from c, then
                         S = q c^T (fp32 out) -> P = softmax(scale S | valid) rounded to the
                         input dtype, lse in fp32 -> O = P latent; flash attention's roundings
                         (`gemm_attention.py`'s passes). Returns O [B, S, N, R] and lse.
  backward:              per block, the keys gathered again, S and dP = dO latent^T recomputed,
                         P and dS rounded as flash does; dQ = dS c, and the gathered keys'
                         gradient dS^T q (+ P^T dO on the latent part), fp32, index_add_-ed
                         into an fp32 dC.

Nothing of size [S, K, C] lives beyond one block: blocks are bounded by `BLOCK_BYTES`
(gathered keys, fp32 scores and dP, bf16 P and dS, fp32 key gradients). The ops are opaque
to torch.compile and listed for activation checkpointing to keep (`parallelize.py`).
Queries may sit anywhere in the row (context-parallel pieces included): the indices say
which keys each one attends, causality and documents included.

Legend: B batch, S queries, T keys, N heads, K slots (top-k), R latent rank (values),
C = R + rope dim (keys), Sb queries of one block.
"""

from __future__ import annotations

import torch

from glmtune.kernels import sparse_mla as sparse_mla_kernels
from glmtune.models.glm5.gemm_attention import _backward_pass, _elementwise, _forward_pass, _matmul_fp32
from glmtune.models.glm5.sparse_mla_attention import fused_absorbed_attention

BLOCK_BYTES = 1 << 30  # per block of queries: gathered keys and score-sized buffers (forward or backward)
INDEX_BYTES = 1 << 28  # per block of queries deriving indices: int64 [Sb, T] slot numbers (twice)


@torch.library.custom_op("glmtune::selected_keys", mutates_args=())
def selected_keys(sparse_BST: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [B, S, K], valid bool [B, S, K]): each query's selected keys in ascending
    order in its first slots, key 0 in the invalid rest. A query selecting more than K keys is an
    error of the caller: its slot numbers overflow the scatter (an index error, never a silent drop)."""
    if sparse_BST.is_cuda and sparse_mla_kernels.triton is not None:  # one Triton pass; this is its reference
        return sparse_mla_kernels.selected_keys(sparse_BST, slots)
    batch, queries, keys = sparse_BST.shape
    index = torch.zeros(batch, queries, slots + 1, dtype=torch.int64, device=sparse_BST.device)
    key_ids = torch.arange(keys, device=sparse_BST.device)
    step = max(1, INDEX_BYTES // (16 * batch * max(keys, 1)))
    for first in range(0, queries, step):
        rows = slice(first, min(first + step, queries))
        mask = sparse_BST[:, rows]
        slot = torch.where(mask, mask.cumsum(-1) - 1, slots)  # unselected keys all land in the spare slot
        index[:, rows].scatter_(-1, slot, key_ids.expand_as(slot))
    count = sparse_BST.sum(-1, keepdim=True)
    valid = torch.arange(slots, device=sparse_BST.device) < count
    return index[..., :slots].contiguous(), valid


@selected_keys.register_fake
def _(sparse_BST, slots):
    batch, queries, _ = sparse_BST.shape
    return (sparse_BST.new_empty(batch, queries, slots, dtype=torch.int64),
            sparse_BST.new_empty(batch, queries, slots, dtype=torch.bool))


def _blocks(batch: int, queries: int, heads: int, slots: int, width: int, itemsize: int):
    """The flat query rows [B x S] of each block, as slices."""
    # Per query: gathered keys (input dtype), fp32 key gradients, fp32 S and dP, P and dS (input dtype).
    per_query = slots * (width * (itemsize + 4) + heads * (8 + 2 * itemsize))
    step = max(1, BLOCK_BYTES // max(per_query, 1))
    total = batch * queries
    for first in range(0, total, step):
        yield slice(first, min(first + step, total))


def _gather(c_XC: torch.Tensor, index_BSK: torch.Tensor, rows: slice, queries: int, keys: int) -> tuple:
    """The flat key rows of a block's slots [Sb, K] (batch b's keys start at b x T) and the keys [Sb, K, C]."""
    flat = index_BSK.view(-1, index_BSK.shape[-1])[rows]
    batch_of = torch.arange(rows.start, rows.stop, device=flat.device) // queries
    flat = flat + (batch_of * keys).unsqueeze(-1)
    return flat, c_XC[flat]


@torch.library.custom_op("glmtune::absorbed_attention", mutates_args=())
def absorbed_attention(q_BSNC: torch.Tensor, c_BTC: torch.Tensor, index_BSK: torch.Tensor, valid_BSK: torch.Tensor,
                       scale: float, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, N, R], lse [B, S, N] fp32): each query over the keys of its valid slots; the
    values are the first R = `value_dim` of each key."""
    batch, queries, heads, width = q_BSNC.shape
    keys, slots = c_BTC.shape[1], index_BSK.shape[-1]
    q = q_BSNC.reshape(batch * queries, heads, width)
    c = c_BTC.reshape(batch * keys, width)
    valid = valid_BSK.reshape(batch * queries, 1, slots)
    out = q.new_empty(batch * queries, heads, value_dim)
    lse = q.new_empty(batch * queries, heads, dtype=torch.float32)
    for rows in _blocks(batch, queries, heads, slots, width, q.element_size()):
        _, keys_SKC = _gather(c, index_BSK, rows, queries, keys)
        s = _matmul_fp32(q[rows], keys_SKC.transpose(1, 2))
        probs, lse[rows] = _elementwise(_forward_pass, s, valid[rows], scale, q.dtype)
        del s
        out[rows] = torch.bmm(probs, keys_SKC[..., :value_dim])
    return out.view(batch, queries, heads, value_dim), lse.view(batch, queries, heads)


@absorbed_attention.register_fake
def _(q_BSNC, c_BTC, index_BSK, valid_BSK, scale, value_dim):
    batch, queries, heads, _ = q_BSNC.shape
    return q_BSNC.new_empty(batch, queries, heads, value_dim), q_BSNC.new_empty(batch, queries, heads,
                                                                                 dtype=torch.float32)


@torch.library.custom_op("glmtune::absorbed_attention_backward", mutates_args=())
def absorbed_attention_backward(grad_out_BSNR: torch.Tensor, q_BSNC: torch.Tensor, c_BTC: torch.Tensor,
                                index_BSK: torch.Tensor, valid_BSK: torch.Tensor, out_BSNR: torch.Tensor,
                                lse_BSN: torch.Tensor, scale: float, value_dim: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [B, S, N, C], dc [B, T, C]): per block S, dP, P and dS recomputed; the gathered keys'
    gradients added into an fp32 dC, rounded once at the end."""
    batch, queries, heads, width = q_BSNC.shape
    keys, slots = c_BTC.shape[1], index_BSK.shape[-1]
    q = q_BSNC.reshape(batch * queries, heads, width)
    c = c_BTC.reshape(batch * keys, width)
    d_out = grad_out_BSNR.reshape(batch * queries, heads, value_dim)
    valid = valid_BSK.reshape(batch * queries, 1, slots)
    lse = lse_BSN.reshape(batch * queries, heads)
    delta = (d_out.float() * out_BSNR.reshape(d_out.shape).float()).sum(-1)  # rowsum(dO * O) [B*S, N]
    dq = torch.empty_like(q)
    dc = torch.zeros(batch * keys, width, dtype=torch.float32, device=c.device)
    for rows in _blocks(batch, queries, heads, slots, width, q.element_size()):
        flat, keys_SKC = _gather(c, index_BSK, rows, queries, keys)
        s = _matmul_fp32(q[rows], keys_SKC.transpose(1, 2))
        dp = _matmul_fp32(d_out[rows], keys_SKC[..., :value_dim].transpose(1, 2))
        probs, dscores = _elementwise(_backward_pass, s, dp, lse[rows], delta[rows], valid[rows], scale, q.dtype)
        del s, dp
        dq[rows] = torch.bmm(dscores, keys_SKC)
        d_keys = _matmul_fp32(dscores.transpose(1, 2), q[rows])  # [Sb, K, C] fp32
        d_keys[..., :value_dim] += _matmul_fp32(probs.transpose(1, 2), d_out[rows])
        dc.index_add_(0, flat.reshape(-1), d_keys.view(-1, width))
    return dq.view(q_BSNC.shape), dc.view(batch, keys, width).to(c_BTC.dtype)


@absorbed_attention_backward.register_fake
def _(grad_out_BSNR, q_BSNC, c_BTC, index_BSK, valid_BSK, out_BSNR, lse_BSN, scale, value_dim):
    return q_BSNC.new_empty(q_BSNC.shape), c_BTC.new_empty(c_BTC.shape)


def _setup_context(ctx, inputs, output):
    q, c, index, valid, scale, value_dim = inputs
    out, lse = output
    ctx.save_for_backward(q, c, index, valid, out, lse)  # nothing of [S, K, C]: the keys are gathered again
    ctx.options = (scale, value_dim)


def _backward(ctx, grad_out, grad_lse):
    q, c, index, valid, out, lse = ctx.saved_tensors
    dq, dc = absorbed_attention_backward(grad_out.contiguous(), q, c, index, valid, out, lse, *ctx.options)
    return dq, dc, None, None, None, None


absorbed_attention.register_autograd(_backward, setup_context=_setup_context)


def absorbed_sparse_attention(q_lat_BSNR: torch.Tensor, q_rot_BSNE: torch.Tensor, c_lat_BTR: torch.Tensor,
                              c_rot_BTE: torch.Tensor, sparse_BST: torch.Tensor, scale: float, slots: int,
                              fused: bool = False, buffer_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """Output latent [B, S, N, R] of queries [q_lat | q_rot] [B, S, N, R + E] over the keys
    [c_lat | c_rot] [B, T, R + E] that the selection mask [B, S, T] marks (at most `slots` per
    query; the values are c_lat), by this module's blocks or, `fused`, by the Triton kernels
    (`sparse_mla_attention.py`, which take the parts as they are), whose backward buffers take at
    most `buffer_bytes` each."""
    index_BSK, valid_BSK = selected_keys(sparse_BST, slots)
    if fused:
        return fused_absorbed_attention(q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE, index_BSK, valid_BSK, scale,
                                        buffer_bytes)
    q_BSNC = torch.cat([q_lat_BSNR, q_rot_BSNE], dim=-1)
    c_BTC = torch.cat([c_lat_BTR, c_rot_BTE], dim=-1)
    return absorbed_attention(q_BSNC, c_BTC, index_BSK, valid_BSK, scale, c_lat_BTR.shape[-1])[0]
