"""The DSA "lightning indexer": picks the top-k keys each query may attend.

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] / sqrt(d)),   w = weights_proj(h) / sqrt(n_heads)

Scores are fp32; disallowed keys (future, other document) are masked *before*
top-k, so they are chosen only when a query has fewer than k allowed keys, and
then stay masked. The indexer is frozen in transformers (no gradient, no
indexer loss), so by default it runs under `no_grad` here too.

Note the rope slice sits *first* in the indexer's heads (last in MLA's).

Backends: "reference" scores all queries at once ([B, S, H, T] fp32, as
transformers does); "chunked" scores blocks of queries over only the keys up to the
block's end, so the fp32 score tensor stays under ~256 MiB (at S = T = 16K, H = 32
the reference would hold 32 GiB); "fused" is "chunked" with the scores from one
Triton kernel (`glmtune.kernels.indexer_scores`) that never writes the per-head
scores; "auto" is "fused" for CUDA tensors when triton is installed, else "chunked".
In one-document rows the first k queries are not scored at all: they select
every key of their past. `tests/models/test_indexer.py` and
`tests/kernels/test_indexer_scores.py` check that the backends select the same keys up
to ties: exact ties (ReLU zeroes every head) may be broken differently by backends that
score different key ranges, and the fused kernel's fp32 sums may reorder scores closer
than their rounding; selections may differ only among keys tied with the k-th score.

The selection runs as one custom op (`glmtune::dsa_topk_mask`) so activation
checkpointing can keep its output instead of recomputing it (`parallelize.py`).

Legend: B batch, S queries, T keys, H indexer heads, D indexer head dim, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmtune.kernels.indexer_scores import available as indexer_scores_available
from glmtune.kernels.indexer_scores import indexer_scores
from glmtune.models.common.rope import apply_interleaved_rope
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.models.glm5.args import Glm5Args

INDEXER_BACKENDS = ("auto", "reference", "chunked", "fused")
_CHUNK_SCORE_BYTES = 256 * 2**20


class Indexer(nn.Module):
    def __init__(self, args: Glm5Args, backend: str = "auto") -> None:
        super().__init__()
        if backend not in INDEXER_BACKENDS:
            raise ValueError(f"indexer backend {backend!r} unknown; choose from {INDEXER_BACKENDS}")
        self.backend = backend
        self.num_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.index_topk = args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.num_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def project(self, x_BSD, q_resid_BSR, cos, sin):
        """Roped queries [B, S, H, D], keys [B, T, D] and head weights [B, S, H] (fp32)."""
        batch, seq_len, _ = x_BSD.shape
        q_BSHD = self.wq_b(q_resid_BSR).view(batch, seq_len, self.num_heads, self.head_dim)
        q_rot, q_pass = q_BSHD.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_BSD = self.k_norm(self.wk(x_BSD))
        k_rot, k_pass = k_BSD.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_rot = apply_interleaved_rope(q_rot, cos.unsqueeze(2), sin.unsqueeze(2))
        k_rot = apply_interleaved_rope(k_rot, cos, sin)
        q_BSHD = torch.cat([q_rot, q_pass], dim=-1)
        k_BTD = torch.cat([k_rot, k_pass], dim=-1)
        weights_BSH = self.weights_proj(x_BSD.to(self.weights_proj.weight.dtype)).float() * self.num_heads**-0.5
        return q_BSHD, k_BTD, weights_BSH

    @staticmethod
    def combine(q_BSHD, k_BTD, weights_BSH, softmax_scale):
        # Same op order as transformers so the fp32 scores (and top-k ties) agree bit for bit.
        scores_BSHT = torch.matmul(q_BSHD.float(), k_BTD.transpose(-1, -2).float().unsqueeze(1))
        scores_BSHT = F.relu(scores_BSHT * softmax_scale)
        return torch.matmul(weights_BSH.unsqueeze(-2), scores_BSHT).squeeze(-2)

    def scores(self, x_BSD, q_resid_BSR, cos, sin) -> torch.Tensor:
        """Index scores [B, S, T] in fp32 (unmasked), all queries at once (the reference)."""
        return self.combine(*self.project(x_BSD, q_resid_BSR, cos, sin), self.softmax_scale)

    def forward(
        self,
        x_BSD: torch.Tensor,
        q_resid_BSR: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed_BST: torch.Tensor,
        sparse_needed: bool = True,
        plain_causal: bool = False,
        shard: SequenceShard | None = None,
        keep_projections: bool = False,
    ) -> tuple[torch.Tensor, bool] | tuple[torch.Tensor, bool, tuple[torch.Tensor, ...]]:
        """The sparse attention mask, bool [B, S, T] (True where allowed and selected), and
        whether it selects every allowed key (then it *is* `allowed_BST`).

        `sparse_needed` is False when no query has more than top-k allowed keys (short
        rows, or packed documents all shorter than k; the model computes it once per
        forward): top-k would then select every allowed key, so the mask is the
        block-causal one. Exact, and it skips the [B, S, H, T] scores. `plain_causal`
        says the rows are single documents: then the first k queries are not scored.

        Under context parallelism (`shard`) the S queries are this rank's share of rows of
        T tokens: the keys [B, T, D] are all-gathered from every rank (with a gradient only
        when the indexer trains) and each local query's top-k is taken over all of them,
        exactly as in one process. `sparse_needed` must be the same on every rank (the
        model derives it from the full rows): the gather is a collective.

        `keep_projections` (the indexer's KL loss, `indexer_loss.py`): the projections (q, k of
        all T keys, head weights) come back as a third element, computed from the *detached*
        inputs (the indexer learns from its KL only) with a graph when gradients are enabled
        and the indexer trains; they are computed (and, under a shard, gathered) even when no
        query needs a selection.
        """
        if keep_projections:
            return self._selection_and_projections(x_BSD, q_resid_BSR, cos, sin, allowed_BST, sparse_needed,
                                                   plain_causal, shard)
        if not sparse_needed:
            return allowed_BST, True
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.wq_b.weight.requires_grad):
            if self.backend == "reference" and shard is None:
                scores_BST = self.scores(x_BSD, q_resid_BSR, cos, sin)
                return self._reference_mask(scores_BST, allowed_BST), False
            q_BSHD, k_BTD, weights_BSH = self.project(x_BSD, q_resid_BSR, cos, sin)
            if shard is not None:
                k_BTD = shard.gather(k_BTD)
            return self._mask(q_BSHD, k_BTD, weights_BSH, allowed_BST, plain_causal, shard), False

    def _selection_and_projections(self, x_BSD, q_resid_BSR, cos, sin, allowed_BST, sparse_needed, plain_causal,
                                   shard):
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.wq_b.weight.requires_grad):
            q_BSHD, k_BTD, weights_BSH = self.project(x_BSD.detach(), q_resid_BSR.detach(), cos, sin)
            if shard is not None:
                k_BTD = shard.gather(k_BTD)
        projections = (q_BSHD, k_BTD, weights_BSH)
        if not sparse_needed:
            return allowed_BST, True, projections
        mask_BST = self._mask(*(t.detach() for t in projections), allowed_BST, plain_causal, shard)
        return mask_BST, False, projections

    def _mask(self, q_BSHD, k_BTD, weights_BSH, allowed_BST, plain_causal, shard) -> torch.Tensor:
        """The top-k selection from the projections (k of all T keys)."""
        if self.backend == "reference":
            return self._reference_mask(self.combine(q_BSHD, k_BTD, weights_BSH, self.softmax_scale), allowed_BST)
        first_query = self.index_topk if plain_causal else 0
        pieces = None if shard is None else [n for piece in shard.pieces(k_BTD.shape[1]) for n in piece]
        return torch.ops.glmtune.dsa_topk_mask(q_BSHD, k_BTD, weights_BSH, allowed_BST, self.softmax_scale,
                                               self.index_topk, first_query, self._fused_for(q_BSHD), pieces)

    def _reference_mask(self, scores_BST: torch.Tensor, allowed_BST: torch.Tensor) -> torch.Tensor:
        scores_BST = scores_BST.masked_fill(~allowed_BST, torch.finfo(scores_BST.dtype).min)
        topk_BSK = scores_BST.topk(self.index_topk, dim=-1).indices
        selected_BST = torch.zeros_like(allowed_BST).scatter(-1, topk_BSK, True)
        return allowed_BST & selected_BST

    def _fused_for(self, q_BSHD: torch.Tensor) -> bool:
        if self.backend == "auto":
            return q_BSHD.is_cuda and indexer_scores_available()
        return self.backend == "fused"

    def reset_parameters(self, std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.k_norm.reset_parameters()


@torch.library.custom_op("glmtune::dsa_topk_mask", mutates_args=())
def dsa_topk_mask(q_BSHD: torch.Tensor, k_BTD: torch.Tensor, weights_BSH: torch.Tensor, allowed_BST: torch.Tensor,
                  softmax_scale: float, topk: int, first_query: int, fused: bool,
                  query_pieces: list[int] | None = None) -> torch.Tensor:
    """Bool [B, S, T]: allowed and among the query's top-k index scores.

    Queries at key index below `first_query` keep every allowed key (the caller knows they
    have at most k). Later queries are scored in chunks: the queries at key indices [a, b)
    over keys [0, b) only (the allowed mask is causal, so later keys can never be chosen).

    `query_pieces` places the queries among the T keys (context parallelism): flat
    (start, length) pairs, the local queries being keys [start, start + length) of each
    pair in turn; None means query i is key i (S == T). The chunks are those of one
    process over all T queries, cut to the local pieces, and each still reads keys
    [0, b) of its whole chunk: a query's top-k then sees the very row of scores it sees
    in one process, so ties at the k-th score break the same way and the selection is
    that of one process, bit for bit.
    """
    batch, seq_len, num_heads, _ = q_BSHD.shape
    num_keys = k_BTD.shape[1]
    if query_pieces is None:
        query_pieces = [0, seq_len]
    mask_BST = allowed_BST.clone()
    heads_held = 1 if fused else num_heads  # the reference holds every head's fp32 scores
    chunk = max(1, _CHUNK_SCORE_BYTES // (4 * batch * heads_held * num_keys))
    local = 0  # local index of the piece's first query
    for piece_start, piece_length in zip(query_pieces[::2], query_pieces[1::2]):
        piece_end = piece_start + piece_length
        first = max(first_query, piece_start)
        for chunk_start in range(first - (first - first_query) % chunk, piece_end, chunk):
            end = min(chunk_start + chunk, num_keys)
            if end <= topk:  # no query here has more than k allowed keys: all selected
                continue
            start = max(chunk_start, first)
            rows = slice(local + start - piece_start, local + min(end, piece_end) - piece_start)
            q_chunk, w_chunk, k_keys = q_BSHD[:, rows], weights_BSH[:, rows], k_BTD[:, :end]
            if fused:
                scores = indexer_scores(q_chunk, k_keys, w_chunk, softmax_scale, causal_offset=start)
            else:
                scores = Indexer.combine(q_chunk, k_keys, w_chunk, softmax_scale)
            allowed_chunk = allowed_BST[:, rows, :end]
            scores = scores.masked_fill(~allowed_chunk, torch.finfo(scores.dtype).min)
            top = scores.topk(topk, dim=-1, sorted=False).indices
            selected = torch.zeros_like(allowed_chunk).scatter_(-1, top, True)
            mask_BST[:, rows, :end] &= selected
        local += piece_length
    return mask_BST


@dsa_topk_mask.register_fake
def _(q_BSHD, k_BTD, weights_BSH, allowed_BST, softmax_scale, topk, first_query, fused, query_pieces=None):
    return torch.empty(allowed_BST.shape, dtype=torch.bool, device=allowed_BST.device)
