"""Indexer recall: the share of the full attention's probability mass the DSA selection keeps.

A layer attends only the keys its indexer selected (top-k of the index scores, or the full layer's
selection it shares). What that costs a query is the attention mass the dense model would have
put on the keys left out. For a sampled query t with more allowed keys than top-k:

    recall_t = sum_{s in S_t} mean_h softmax_h(q_h[t] . k_h[s] x scale over every allowed s)

the dense attention over every allowed key (causal, same document), averaged over the heads,
summed over the selected keys S_t. 1 means the selection holds everything dense attention
would read; an indexer that falls behind a fine-tuned attention drops below its base's value.
Queries with at most top-k allowed keys select every one of them (recall 1 by construction) and
are not sampled.

`measure_recall` runs a forward with a hook on each decoder layer's attention: from the layer's
own input it recomputes the queries and keys (`MLAttention.project`, `keys_and_values`) for up
to `QUERIES_PER_ROW` sampled queries per row, evenly spaced among those with a real selection,
in chunks of queries (never every head's [S, T] scores at once). Evaluation only: one process or
data/expert-parallel ranks (no context parallelism: a hook sees only its rank's queries).

Legend: B batch, S queries, T keys, N heads, K qk head dim, n sampled queries of a chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.models.glm5.attention import MLAttention

QUERIES_PER_ROW = 256
_CHUNK = 32  # sampled queries per dense pass: N x 32 x T fp32 scores


def sampled_queries(allowed_BST: torch.Tensor, topk: int, per_row: int = QUERIES_PER_ROW) -> list[torch.Tensor]:
    """Per row, the indices of up to `per_row` queries with more than `topk` allowed keys, evenly spaced."""
    picked = []
    for counts_S in allowed_BST.sum(-1):
        eligible = (counts_S > topk).nonzero().squeeze(1)
        if eligible.numel() > per_row:
            eligible = eligible[torch.linspace(0, eligible.numel() - 1, per_row, device=eligible.device).long()]
        picked.append(eligible)
    return picked


def selection_recall(q_BNSK, k_BNTK, scale: float, allowed_BST, selected_BST, picked: list[torch.Tensor]):
    """fp32 [2]: (sum over the picked queries of the dense attention mass on their selected keys, count)."""
    total = torch.zeros((), dtype=torch.float64, device=q_BNSK.device)
    count = 0
    for b, queries in enumerate(picked):
        for start in range(0, queries.numel(), _CHUNK):
            rows = queries[start:start + _CHUNK]
            logits_NnT = torch.matmul(q_BNSK[b][:, rows].float(), k_BNTK[b].float().transpose(-1, -2)) * scale
            logits_NnT = logits_NnT.masked_fill(~allowed_BST[b, rows], float("-inf"))
            probs_nT = logits_NnT.softmax(-1).mean(0)
            total += (probs_nT * selected_BST[b, rows]).sum(-1).double().sum()
            count += rows.numel()
    return torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=total.device)]).float()


class RecallProbe:
    """Forward hooks on the decoder layers' attention that add up `selection_recall` of each layer."""

    def __init__(self, layers: list[nn.Module], topk: int) -> None:
        self.topk = topk
        self.sums = None
        self.handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True) for layer in layers]

    def _hook(self, attention: MLAttention, args, kwargs, output) -> None:
        x_BSD, cos, sin, allowed_BST = args[:4]
        assert len(args) < 8 or args[7] is None, "indexer recall is measured without context parallelism"
        picked = sampled_queries(allowed_BST, self.topk)
        if not sum(p.numel() for p in picked):
            return
        q_BNSK, _, latent_BSR, k_rot_B1SK = attention.project(x_BSD, cos, sin)
        k_BNTK, _ = attention.keys_and_values(latent_BSR, k_rot_B1SK)
        selected_BST = output[1][0]
        pair = selection_recall(q_BNSK, k_BNTK, attention.scale, allowed_BST, selected_BST, picked)
        self.sums = pair if self.sums is None else self.sums + pair

    def close(self) -> torch.Tensor | None:
        """The (mass, queries) sums over every layer and forward since the probe began (None: no query)."""
        for handle in self.handles:
            handle.remove()
        return self.sums
