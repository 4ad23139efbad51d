"""The DSA "lightning indexer": picks the top-k keys each query may attend.

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] / sqrt(d)),   w = weights_proj(h) / sqrt(n_heads)

Scores are fp32; disallowed keys (future, other document) are masked *before*
top-k, so they are chosen only when a query has fewer than k allowed keys, and
then stay masked. The indexer is frozen in transformers (no gradient, no
indexer loss), so by default it runs under `no_grad` here too.

Note the rope slice sits *first* in the indexer's heads (last in MLA's).

Backends: "reference" scores all queries at once ([B, S, H, T] fp32, as
transformers does); "chunked" scores blocks of queries so the fp32 score tensor
stays under ~256 MiB (at S = T = 16K, H = 32 the reference would hold 32 GiB).
Both run the same per-element arithmetic; `tests/models/test_indexer.py` checks
that they select the same keys.

Legend: B batch, S queries, T keys, H indexer heads, D indexer head dim, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmtune.models.common.rope import apply_interleaved_rope
from glmtune.models.glm5.args import Glm5Args

INDEXER_BACKENDS = ("reference", "chunked")
_CHUNK_SCORE_BYTES = 256 * 2**20


class Indexer(nn.Module):
    def __init__(self, args: Glm5Args, backend: str = "chunked") -> None:
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

    def _select_chunked(self, x_BSD, q_resid_BSR, cos, sin, allowed_BST) -> torch.Tensor:
        q_BSHD, k_BTD, weights_BSH = self.project(x_BSD, q_resid_BSR, cos, sin)
        batch, seq_len, num_heads, _ = q_BSHD.shape
        num_keys = k_BTD.shape[1]
        chunk = max(1, _CHUNK_SCORE_BYTES // (4 * batch * num_heads * num_keys))
        topk_BSK = torch.empty(batch, seq_len, self.index_topk, dtype=torch.long, device=x_BSD.device)
        for start in range(0, seq_len, chunk):
            end = min(start + chunk, seq_len)
            scores = self.combine(q_BSHD[:, start:end], k_BTD, weights_BSH[:, start:end], self.softmax_scale)
            scores = scores.masked_fill(~allowed_BST[:, start:end], torch.finfo(scores.dtype).min)
            topk_BSK[:, start:end] = scores.topk(self.index_topk, dim=-1).indices
        return topk_BSK

    def forward(
        self,
        x_BSD: torch.Tensor,
        q_resid_BSR: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed_BST: torch.Tensor,
        sparse_needed: bool = True,
    ) -> tuple[torch.Tensor, bool]:
        """The sparse attention mask, bool [B, S, T] (True where allowed and selected), and
        whether it selects every allowed key (then it *is* `allowed_BST`).

        `sparse_needed` is False when no query has more than top-k allowed keys (short
        rows, or packed documents all shorter than k; the model computes it once per
        forward): top-k would then select every allowed key, so the mask is the
        block-causal one. Exact, and it skips the [B, S, H, T] scores.
        """
        if not sparse_needed:
            return allowed_BST, True
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.wq_b.weight.requires_grad):
            if self.backend == "chunked":
                topk_BSK = self._select_chunked(x_BSD, q_resid_BSR, cos, sin, allowed_BST)
            else:
                scores_BST = self.scores(x_BSD, q_resid_BSR, cos, sin)
                scores_BST = scores_BST.masked_fill(~allowed_BST, torch.finfo(scores_BST.dtype).min)
                topk_BSK = scores_BST.topk(self.index_topk, dim=-1).indices
        selected_BST = torch.zeros_like(allowed_BST).scatter(-1, topk_BSK, True)
        return allowed_BST & selected_BST, False

    def reset_parameters(self, std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.k_norm.reset_parameters()
