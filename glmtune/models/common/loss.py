"""Causal-LM loss that never materializes fp32 logits over the whole vocabulary.

`chunked_cross_entropy` runs the LM head and cross-entropy over slices of tokens;
each slice is recomputed in backward (activation checkpointing), so at most one
slice of [chunk, V] fp32 logits is alive at a time. For GLM-5's 154,880-token
vocabulary at 4K tokens this saves ~2.5 GB per micro-batch. `full_cross_entropy`
is the plain reference it is tested against.

Targets are next-token ids aligned with the inputs (`targets[t]` is the token
that should follow position t, -100 where no loss applies), so no shift happens
here and packed rows never predict across a document boundary.

Legend: N tokens, D model dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    logits_NV = F.linear(hidden_ND, weight_VD).float()
    return F.cross_entropy(logits_NV, targets_N, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, targets_BS: torch.Tensor, chunk_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and the number of supervised tokens."""
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    targets_N = targets_BS.reshape(-1)
    keep = targets_N != IGNORE_INDEX
    num_tokens = keep.sum()
    # Only supervised positions pay for the LM head (assistant-only loss skips most).
    hidden_ND, targets_N = hidden_ND[keep], targets_N[keep]
    total = hidden_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_ND.shape[0], chunk_size):
        h, t = hidden_ND[start : start + chunk_size], targets_N[start : start + chunk_size]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, h, weight_VD, t, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, weight_VD, t)
    return total, num_tokens


def full_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: fp32 cross-entropy over materialized logits (sum, count)."""
    targets_N = targets_BS.reshape(-1)
    loss = F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), targets_N,
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets_N != IGNORE_INDEX).sum()
