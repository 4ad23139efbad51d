"""The preference objective (`train.objective: dpo`) as the trainer sees it: a loss function and
its units.

A micro-batch is packed preference rows: in each row documents 2i and 2i+1 are the chosen and
rejected answers of pair i, a pair never split across rows (`glmtune/data/packing.py`). The loss
function runs the model once for the policy's per-token log-probabilities and, for a LoRA run's
reference, once more with the adapters switched off under no_grad (the starting model, no second
copy of the weights); `dpo.reference: none` (SimPO) has no reference. Sequence log-probabilities
are sums over each completion's supervised tokens (`preference_loss.pair_logps`).

The trainer divides each micro-batch's loss sum by the step's pairs (over its micro-batches and
data-parallel ranks), so the update is the mean over the step's pairs, as TRL's over its batch;
the SFT term (`dpo.sft_weight`) is a mean over the step's chosen tokens, so the loss sum carries it
as `pairs of the step / chosen tokens of the step` × the micro-batch's chosen NLL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from glmtune.config import DpoConfig
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.peft.lora import adapters_disabled
from glmtune.train.preference_loss import pair_logps, preference_loss

# Per-pair statistics the trainer logs (as dpo/<name>, means over the step's pairs).
STATS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy", "logps_chosen", "logps_rejected")


def pair_counts(batch: dict[str, Any]) -> dict[str, int]:
    """The step totals the preference loss needs, from a micro-batch's host tensors: its pairs
    (the loss's unit) and its chosen answers' supervised tokens (the SFT term's)."""
    documents = batch["document_ids"]
    chosen = (batch["targets"] != IGNORE_INDEX) & (documents >= 0) & (documents % 2 == 0)
    return {"pairs": int(((documents.max(dim=1).values + 1) // 2).sum()), "chosen_tokens": int(chosen.sum())}


def documents_per_row(batch: dict[str, Any]) -> dict[str, Any]:
    """Host fact for the loss: the number of documents of each row (ids 0..n-1, padding -1)."""
    return {"documents_per_row": (batch["document_ids"].max(dim=1).values + 1).tolist()}


@dataclass
class PreferenceObjective:
    """`loss(model, batch) -> (loss sum, pairs, statistics' sums)` for the trainer."""

    token_logps: Callable[[nn.Module, dict[str, Any]], torch.Tensor]  # the model family's spec.token_logps
    dpo: DpoConfig
    lora: bool  # the reference is the model with its adapters off (else dpo.reference must be none)

    def reference_logps(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        if self.dpo.reference == "none":
            return None
        assert self.lora, "a full fine-tuning reference needs the reference log-probability cache"
        with torch.no_grad(), adapters_disabled(model):
            token_logps = self.token_logps(model, batch)
        return pair_logps(token_logps, batch["targets"], batch["document_ids"], batch["documents_per_row"])

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        ref = self.reference_logps(model, batch)
        policy = pair_logps(self.token_logps(model, batch), batch["targets"], batch["document_ids"],
                            batch["documents_per_row"])
        d = self.dpo
        per_pair, stats = preference_loss(
            policy["chosen"], policy["rejected"], ref["chosen"] if ref else None, ref["rejected"] if ref else None,
            chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"], loss=d.loss,
            beta=d.beta, label_smoothing=d.label_smoothing, reference=d.reference, simpo_gamma=d.simpo_gamma)
        sums = {name: stats[name].float().sum() for name in STATS}
        loss_sum = per_pair.sum()
        totals = batch["step_totals"]
        # The chosen NLL, weighted so that dividing by the step's pairs gives its mean per chosen token.
        sft = -policy["chosen"].sum() * (totals["pairs"] / max(totals["chosen_tokens"], 1))
        sums["sft_loss"] = sft.detach()
        if d.sft_weight:
            loss_sum = loss_sum + d.sft_weight * sft
        return loss_sum, torch.tensor(per_pair.shape[0], device=per_pair.device), sums


def preference_summary(val_stats: dict[str, float]) -> str:
    """The validation pairs' accuracy and reward margin as the end of a console line ("" for other
    objectives)."""
    if "val_dpo/accuracy" not in val_stats:
        return ""
    return (f" (validation pairs: preference accuracy {val_stats['val_dpo/accuracy']:.0%}, "
            f"reward margin {val_stats['val_dpo/margin']:.3f})")
