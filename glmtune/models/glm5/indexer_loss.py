"""The DSA indexer's KL loss (DeepSeek-V3.2's sparse stage; `train.indexer_loss_weight`).

For every counted query t (not padding) of a layer that attends the indexer selection S_t:

    p_t(s) = sum_h P_h(t, s) / sum_{s'} sum_h P_h(t, s')      s in S_t
    q_t(s) = softmax_{s in S_t} I[t, s]
    KL_t   = sum_{s in S_t} p_t(s) (log p_t(s) - log q_t(s))

P_h are the main attention's probabilities (they attend exactly S_t, so p is their head mean)
and I the index scores as `Indexer.combine` computes them, sum_j w[t, j] ReLU(q[t, j] . k[s] /
sqrt(d)), from the indexer's projections of the *detached* layer input and q_resid. p has no
gradient and the indexer's inputs none either: the indexer learns from the KL only, the main
model from the LM loss only. When a query has no more allowed keys than top-k (or attention is
dense), S_t is every allowed key: the dense warm-up's distribution.

Shared-indexer layers (GLM-5.2/5.3 IndexShare) attend the latest full layer's selection: each
such layer adds its own KL against the owner's q (the selection carries the owner's
projections with their graph), so an indexer learns sum_l KL(p_l || q), which is
L x KL(mean_l p_l || q) up to a constant: the KL to the mean distribution of the layers it serves.

One custom op per layer (`glmtune::indexer_kl`, opaque to torch.compile) computes it in query
chunks, never a [B, S, T] tensor per head, and returns the KL sum and the number of counted
queries, and, when the indexer trains, the gradient of the KL sum with respect to the
indexer's q, k and head weights: the derivative dKL_t / dI[t, s] = q_t(s) - p_t(s) is known in
the forward, so the backward only scales the saved gradients (no second pass; under
activation checkpointing the op is kept, `parallelize.py`). p is recomputed from the main
attention's q and k (detached), per chunk:
  * "dense": the chunk's queries against keys [0, end) under the selection mask, [B, N, c, end]
    fp32 logits: the warm-up (all allowed keys) and chunks whose key range is short;
  * "gather": each query's selected keys (at most top-k) gathered from the compressed KV
    (normed latent | roped k_rot, shared by the heads) and the query absorbed into the latent
    (q_nope W_kb, MLA's absorption: exact in exact arithmetic), [B, c, N, K] logits: the
    sparse selection of long rows, top-k keys per query whatever the row length.
The main attention's kernels keep only their output and per-head log-sum-exp, not P: reusing
the lse would save the row max/sum of the recomputed logits but not the q.k products (nor the
passes over the [heads x keys] probabilities), so p is recomputed; a fused kernel (q.k per
tile, exp(s - lse) summed over heads on the fly, the attention's lse reused) is what would
remove the fp32 logits' memory passes that dominate below. The GEMMs take the bf16 inputs as
they are (fp32 products and output), the KL and q - p are taken in fp64 ([B, c, K]: near
agreement, e.g. a fresh indexer at ~1e-4 nats a query, they are differences of nearly equal
fp32 numbers). On CUDA the gathered keys' gradient is summed with atomics (`index_add_`):
not bit-reproducible run to run.

Cost, a first development measurement (2026-12-03; the recorded ones, docs/benchmarks.md
2026-12-04: the 4-layer proxy's step 0.72x tokens/s at 4,096, 0.63x at 16,384 + AC; one rank of
recipes/glm5/sft_32k_cp8.yaml 1.49x its compute) on an H200 at GLM-5's widths (64 heads, qk 256, latent 512 + 64, indexer 32 x
128, top-k 2048, bf16, one row of one document), per layer, forward with the indexer's
gradient, against the layer's sparse attention forward + backward (Triton backend):
    4,096 tokens   17.8 ms vs 7.4 ms  (dense chunks: no query has many more keys than k)
    16,384 tokens  160 ms vs 124 ms   (gathered selections)
    16,384 dense   271 ms vs 71 ms    (the warm-up, against dense causal attention; the
                                       main model's backward does not run then)
with ~1.0-1.3 GiB of transient memory (`CHUNK_BYTES`). A training step of the 4-layer GLM-5
proxy at 4,096 tokens (`benchmarks/auxiliary_losses.py`, side "indexer") takes 1.36x the
step without the KL (0.265 s vs 0.196 s); peak memory +0.4%.

Legend: B batch, S queries, T keys, N attention heads, H indexer heads, D indexer head dim,
K qk head dim (nope | rope), P nope dim, R latent rank, C = R + rope dim, c queries of a chunk.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from glmtune.models.common.aux_loss import attach

CHUNK_BYTES = 2**30  # fp32 working set of one query chunk (logits, scores, their gradients)
GATHER = None  # None: "gather" where it reads fewer bytes than "dense"; True / False force one (tests)


@dataclass(frozen=True)
class IndexerKLRequest:
    """What a decoder layer needs to compute its indexer KL (None: no KL)."""

    queries_BS: torch.Tensor | None  # bool [B, S]: the queries that count (not padding); None: all
    most_keys: int  # the most allowed keys any query has (the rows' longest document)
    indexer_only: bool = False  # the warm-up: the main model runs without gradients, the KL graph is built


@dataclass
class IndexerKL:
    """One forward's indexer KL: the layers' request, the gradient factor and what they report.

    `collect` takes each layer's (KL sum, counted queries): the statistics add up (detached),
    and the KL sum is attached (`aux_loss.attach`) to the layer's output with `grad_scale`, so
    the main backward differentiates it where the layer's own backward runs (pipeline stages,
    recomputed layers included). When the output has no gradient (the warm-up: the main model
    runs without one) the KL sums wait in `pending` for the caller to attach to its loss.
    """

    request: IndexerKLRequest
    grad_scale: float | None = None  # weight / (counted queries of the step x KL layers); None: reported only
    stats: torch.Tensor | None = None  # [2] (KL sum, counted queries) over the layers so far, detached
    pending: list[torch.Tensor] = field(default_factory=list)

    def grad_context(self):
        """Where a layer is called: with gradients in the warm-up, whose caller runs without them (the
        layer computes its indexer's graph only, and a sharded wrapper, FSDP2, registers its backward
        hooks only on a forward called with gradients)."""
        return torch.enable_grad() if self.request.indexer_only else nullcontext()

    def collect(self, h_BSD: torch.Tensor, kl_stats: torch.Tensor) -> torch.Tensor:
        stats = kl_stats.detach()
        self.stats = stats if self.stats is None else self.stats + stats
        if self.grad_scale is None:
            return h_BSD
        if h_BSD.requires_grad:
            return attach(h_BSD, kl_stats[0], self.grad_scale)
        self.pending.append(kl_stats)  # whole: a view taken here, without gradients, would have no graph
        return h_BSD

    def attach_pending(self, carrier: torch.Tensor) -> torch.Tensor:
        """`carrier` carrying the KL sums that no layer output could (the warm-up)."""
        if self.grad_scale is None or not self.pending:
            return carrier
        return attach(carrier, torch.stack(self.pending)[:, 0].sum(), self.grad_scale)


def indexer_kl(q_BNSK, k_BNTK, kv_BTC, w_kb_NPR, scale: float, projections, softmax_scale: float,
               selected_BST, queries_BS, most_keys: int, query_pieces=None) -> torch.Tensor:
    """[2] (KL sum over the counted queries, their number) of one layer, differentiable with respect to
    the indexer's projections (q [B, S, H, D], k [B, T, D], head weights [B, S, H]) when they need it.

    q_BNSK / k_BNTK: the main attention's queries and keys (keys [0, T'), T' >= the last query's
    key + 1), kv_BTC its compressed keys (latent | k_rot) over the same T', w_kb_NPR kv_b's key
    rows per head, all detached here; `selected_BST` the selection the layer attended (within
    the allowed mask); `most_keys` a bound on any query's selected keys; `query_pieces` as
    `dsa_topk_mask` takes them (context parallelism).
    """
    q_BSHD, k_BTD, weights_BSH = projections
    with_grads = torch.is_grad_enabled() and any(t.requires_grad for t in projections)
    if queries_BS is None:
        queries_BS = torch.ones(selected_BST.shape[:2], dtype=torch.bool, device=selected_BST.device)
    out = torch.ops.glmtune.indexer_kl(q_BNSK.detach(), k_BNTK.detach(), kv_BTC.detach(), w_kb_NPR.detach(), scale,
                                       q_BSHD, k_BTD, weights_BSH, softmax_scale, selected_BST, queries_BS,
                                       most_keys, query_pieces, with_grads)
    return out[0]


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bmm(a_GMK: torch.Tensor, b_GKN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[G, M, N] in `dtype`: bf16/fp16 CUDA inputs multiply as they are with fp32 products and
    output (no fp32 copies, tensor-core speed), anything else in `dtype` itself."""
    if dtype == torch.float32 and a_GMK.is_cuda and a_GMK.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a_GMK, b_GKN.to(a_GMK.dtype), out_dtype=torch.float32)
    return torch.bmm(a_GMK.to(dtype), b_GKN.to(dtype))


def _head_mean_probs(logits, allowed, scale: float, head_dim: int):
    """softmax(scale x logits) over the allowed keys (last dim), averaged over the heads (`head_dim`);
    `logits` (fp32, this chunk's own) is overwritten: every pass over them costs as much as their GEMM."""
    logits.mul_(scale).masked_fill_(~allowed, float("-inf"))  # every query allows a key: no empty row
    return torch.softmax(logits, dim=-1).mean(head_dim)


def _index_scores(pre_BcHK, weights_BcH, softmax_scale: float):
    """(I = sum_j w_j ReLU(scale x q_j . k) [B, c, K], the ReLU [B, c, H, K], in place of the raw products)."""
    relu = pre_BcHK.mul_(softmax_scale).relu_()
    return torch.matmul(weights_BcH.unsqueeze(-2), relu).squeeze(-2), relu


def _kl_tail(p_BcK, scores_BcK, valid_BcK, counted_Bc1):
    """(KL sum of the counted queries, dKL/dI [B, c, K] in p's dtype): in fp64, where near agreement (a
    fresh indexer, ~1e-4 nats a query) both are differences of nearly equal fp32 numbers."""
    p, scores = p_BcK.double(), scores_BcK.double()
    log_q = torch.log_softmax(scores.masked_fill(~valid_BcK, float("-inf")), dim=-1)
    terms = valid_BcK & counted_Bc1
    kl = torch.where(terms, torch.xlogy(p, p) - p * log_q, 0.0).sum()
    return kl, torch.where(terms, torch.exp(log_q) - p, 0.0).to(p_BcK.dtype)


def _index_grads(relu_BcHK, weights_BcH, grad_BcK, softmax_scale: float, dtype: torch.dtype):
    """dKL/dweights [B, c, H] and dKL/d(q . k) [B, c, H, K] (in `dtype`, the GEMMs' input) from dKL/dI."""
    grad_weights = torch.matmul(relu_BcHK, grad_BcK.unsqueeze(-1)).squeeze(-1)
    grad_pre = torch.where(relu_BcHK > 0, (weights_BcH * softmax_scale).unsqueeze(-1), 0.0)
    return grad_weights, grad_pre.mul_(grad_BcK.unsqueeze(-2)).to(dtype)


def _selected_keys(selected_BcT: torch.Tensor, slots: int):
    """(key indices [B, c, K] of each query's selected keys in key order, which of the K are real)."""
    batch, rows, keys = selected_BcT.shape
    slot = torch.where(selected_BcT, selected_BcT.cumsum(-1) - 1, slots)  # unselected keys: a spare slot
    index = torch.arange(keys, device=selected_BcT.device).expand(batch, rows, keys)
    idx = torch.zeros(batch, rows, slots + 1, dtype=torch.long, device=selected_BcT.device).scatter_(-1, slot, index)
    valid = torch.arange(slots, device=selected_BcT.device) < selected_BcT.sum(-1, keepdim=True)
    return idx[..., :slots], valid


def _chunks(num_queries: int, pieces: list[int] | None, plan):
    """(local rows, key index of the first of them, rows, gather) of each chunk, pieces in order;
    `plan(key)` says how a chunk starting at query key `key` runs: (gather, at most this many rows)."""
    pieces = [0, num_queries] if pieces is None else pieces
    local = 0
    for start, length in zip(pieces[::2], pieces[1::2]):
        offset = 0
        while offset < length:
            gather, rows = plan(start + offset)
            rows = min(rows, length - offset)
            yield slice(local + offset, local + offset + rows), start + offset, rows, gather
            offset += rows
        local += length


def _gathers(end: int, slots: int, qk_dim: int, kv_dim: int) -> bool:
    """Whether the "gather" path reads fewer bytes than "dense" for queries whose keys end at `end`."""
    if GATHER is not None:
        return GATHER and slots < end
    return slots * kv_dim < end * qk_dim


@torch.library.custom_op("glmtune::indexer_kl", mutates_args=())
def _indexer_kl_op(q_BNSK: torch.Tensor, k_BNTK: torch.Tensor, kv_BTC: torch.Tensor, w_kb_NPR: torch.Tensor,
                   scale: float, q_BSHD: torch.Tensor, k_BTD: torch.Tensor, weights_BSH: torch.Tensor,
                   softmax_scale: float, selected_BST: torch.Tensor, queries_BS: torch.Tensor, most_keys: int,
                   query_pieces: list[int] | None, with_grads: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stats [2], dKL/dq, dKL/dk, dKL/dweights) of `indexer_kl`; the gradients are empty without `with_grads`."""
    dtype = _accumulation_dtype(q_BNSK)
    gemm_dtype = q_BSHD.dtype if dtype == torch.float32 else dtype  # the indexer's gradient GEMMs' inputs
    batch, num_heads, num_queries, qk_dim = q_BNSK.shape
    index_heads, index_dim = q_BSHD.shape[2], q_BSHD.shape[3]
    nope, kv_dim = w_kb_NPR.shape[1], kv_BTC.shape[-1]
    slots = min(most_keys, selected_BST.shape[-1])
    # row offsets of each batch row in the flattened [B x T', C] compressed keys and [B x T, D] index keys
    kv_rows = torch.arange(batch, device=q_BNSK.device).view(batch, 1, 1) * kv_BTC.shape[1]
    key_rows = torch.arange(batch, device=q_BNSK.device).view(batch, 1, 1) * k_BTD.shape[1]
    kl_sum = torch.zeros((), dtype=torch.float64, device=q_BNSK.device)
    count = queries_BS.sum().to(torch.float64)
    if with_grads:
        dq_BSHD = torch.zeros(q_BSHD.shape, dtype=dtype, device=q_BSHD.device)
        dk_BTD = torch.zeros(k_BTD.shape, dtype=dtype, device=k_BTD.device)
        dw_BSH = torch.zeros(weights_BSH.shape, dtype=dtype, device=weights_BSH.device)
    # fp32 bytes per query and key: the main logits and their softmax, the index products and gradient
    per_key = 4 * batch * (2 * num_heads + 2 * index_heads)
    dense_rows = max(1, CHUNK_BYTES // (per_key * selected_BST.shape[-1]))
    gather_rows = max(1, CHUNK_BYTES // ((per_key + 4 * batch * (kv_dim + index_dim)) * max(slots, 1)))

    def plan(key: int):
        gather = _gathers(key + 1, slots, qk_dim, kv_dim)
        return gather, gather_rows if gather else dense_rows

    for rows, first_key, num_rows, gather in _chunks(num_queries, query_pieces, plan):
        end = first_key + num_rows  # keys [0, end) hold every allowed key of the chunk's queries
        selected = selected_BST[:, rows, :end]
        q = q_BSHD[:, rows]
        if gather:  # [B, c, N, K] logits over each query's own keys
            idx_BcK, valid = _selected_keys(selected, slots)
            q_nope, q_rot = q_BNSK[:, :, rows].split([nope, qk_dim - nope], dim=-1)
            q_lat = _bmm(q_nope.transpose(0, 1).reshape(num_heads, batch * num_rows, nope), w_kb_NPR, dtype)
            q_lat = q_lat.to(q_rot.dtype).view(num_heads, batch, num_rows, -1).permute(1, 2, 0, 3)
            q_abs = torch.cat([q_lat, q_rot.transpose(1, 2)], dim=-1).reshape(batch * num_rows, num_heads, kv_dim)
            # whole rows (index_select), not elements: the gathers move C and D values per selected key
            kv = kv_BTC.reshape(-1, kv_dim).index_select(0, (idx_BcK + kv_rows).flatten())
            kv = kv.view(batch * num_rows, slots, kv_dim)
            logits = _bmm(q_abs, kv.transpose(1, 2), dtype).view(batch, num_rows, num_heads, slots)
            p = _head_mean_probs(logits, valid.unsqueeze(2), scale, 2)
            key_index = (idx_BcK + key_rows).flatten()
            keys = k_BTD.reshape(-1, index_dim).index_select(0, key_index).view(batch * num_rows, slots, index_dim)
            pre = _bmm(q.reshape(batch * num_rows, index_heads, index_dim), keys.transpose(1, 2),
                       dtype).view(batch, num_rows, index_heads, slots)
        else:  # [B, N, c, end] logits over keys [0, end), the selection a mask
            valid = selected
            logits = _bmm(q_BNSK[:, :, rows].reshape(batch * num_heads, num_rows, qk_dim),
                          k_BNTK[:, :, :end].flatten(0, 1).transpose(1, 2), dtype)
            p = _head_mean_probs(logits.view(batch, num_heads, num_rows, end), selected.unsqueeze(1), scale, 1)
            keys = k_BTD[:, :end]
            pre = _bmm(q.reshape(batch, num_rows * index_heads, index_dim), keys.transpose(1, 2),
                       dtype).view(batch, num_rows, index_heads, end)
        weights = weights_BSH[:, rows].to(dtype)
        scores, relu = _index_scores(pre, weights, softmax_scale)
        kl, grad_scores = _kl_tail(p, scores, valid, queries_BS[:, rows].unsqueeze(-1))
        kl_sum += kl
        if not with_grads:
            continue
        dw_BSH[:, rows], grad_pre = _index_grads(relu, weights, grad_scores, softmax_scale, gemm_dtype)
        if gather:
            grad_pre = grad_pre.flatten(0, 1)  # [B*c, H, K]
            dq_BSHD[:, rows] = _bmm(grad_pre, keys, dtype).view(q.shape)
            dkeys = _bmm(grad_pre.transpose(1, 2), q.flatten(0, 1), dtype)  # [B*c, K, D]
            dk_BTD.view(-1, index_dim).index_add_(0, key_index, dkeys.view(-1, index_dim))
        else:
            grad_pre = grad_pre.flatten(1, 2)  # [B, c*H, end]
            dq_BSHD[:, rows] = _bmm(grad_pre, keys, dtype).view(q.shape)
            dk_BTD[:, :end] += _bmm(grad_pre.transpose(1, 2), q.flatten(1, 2), dtype)
    stats = torch.stack([kl_sum, count])
    if not with_grads:
        empty = q_BSHD.new_empty(0)
        return stats, empty, empty.clone(), empty.clone()
    return stats, dq_BSHD.to(q_BSHD.dtype), dk_BTD.to(k_BTD.dtype), dw_BSH.to(weights_BSH.dtype)


@_indexer_kl_op.register_fake
def _(q_BNSK, k_BNTK, kv_BTC, w_kb_NPR, scale, q_BSHD, k_BTD, weights_BSH, softmax_scale, selected_BST,
      queries_BS, most_keys, query_pieces, with_grads):
    stats = q_BNSK.new_empty(2, dtype=torch.float64)
    if not with_grads:
        return stats, q_BSHD.new_empty(0), q_BSHD.new_empty(0), q_BSHD.new_empty(0)
    return stats, q_BSHD.new_empty(q_BSHD.shape), k_BTD.new_empty(k_BTD.shape), weights_BSH.new_empty(weights_BSH.shape)


def _setup_context(ctx, inputs, output):
    _, dq, dk, dw = output
    ctx.save_for_backward(dq, dk, dw)


def _backward(ctx, grad_stats, _grad_dq, _grad_dk, _grad_dw):
    dq, dk, dw = ctx.saved_tensors
    g = grad_stats[0]
    return None, None, None, None, None, g * dq, g * dk, g * dw, None, None, None, None, None, None


_indexer_kl_op.register_autograd(_backward, setup_context=_setup_context)
