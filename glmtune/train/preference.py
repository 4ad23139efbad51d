"""The preference objective (`train.objective: dpo`) as the trainer sees it: a loss function and
its units.

A micro-batch is packed preference rows: in each row documents 2i and 2i+1 are the chosen and
rejected answers of pair i, a pair never split across rows (`glmtune/data/packing.py`). The
objective is a `RowsLoss` (models/common/step_runner.py): the model family's step runner runs the
model for the policy's per-token log-probabilities and calls it with the rows. The reference's
come with the micro-batch (`MicroBatch.ref_token_logps`): a full fine-tuning run's are computed
before training (`reference_logps.py`), a LoRA run's just before each micro-batch runs
(`prepare`: the runner's forward with the adapters switched off, under no_grad: the starting
model, no second copy of the weights); `dpo.reference: none` (SimPO) has no reference. Sequence
log-probabilities are sums over each completion's supervised tokens (`preference_loss.pair_logps`).

The trainer divides each micro-batch's loss sum by the step's pairs (over its micro-batches and
data-parallel ranks), so the update is the mean over the step's pairs, as TRL's over its batch;
the SFT term (`dpo.sft_weight`) is a mean over the step's chosen tokens, so the loss sum carries it
as `pairs of the step / chosen tokens of the step` × the micro-batch's chosen NLL.

Layouts:
  * Context parallelism: a cp rank's forward gives the log-probabilities of its slice of each
    row's tokens. The step runner gathers them into the full rows first (the model's own
    differentiable `sequence_shard.gather`, `glmtune/distributed/context_parallel.py`), so every cp rank sums
    each document over all its tokens, in the one-process order, and computes the same pair
    losses from the host's full `targets` and `document_ids` (the same document slots on every
    rank). The gather's backward sums the cp ranks' row gradients: with each rank backpropagating
    the whole loss, every token's gradient would be cp times the one-process one, so each rank
    returns 1/cp of the loss sum (and of the pair count): summed over the cp ranks — the
    gradients by FSDP2's reduction over dp_shard x cp, the logged loss by the trainer's all-reduce
    — they count once. The statistics are not divided: the trainer sums them over the
    data-parallel ranks only (cp ranks share rows).
  * Pipeline parallelism: the step runner's last stage turns each pipeline microbatch's hidden
    states into the targets' log-probabilities and calls this objective with those rows. Pipeline
    microbatches are whole rows, so a pair never splits across them. The LoRA reference is a
    forward-only pass through the pipeline with the adapters off, before the schedule's step on
    the same rows. Loss sums, pairs and statistics are the last stage's (zeros on other stages):
    the trainer sums them over the pipeline.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from glmtune.config import DpoConfig
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import StepRunner
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


def _rows_pair_logps(token_logps_BT: torch.Tensor, rows: MicroBatch) -> dict[str, torch.Tensor]:
    return pair_logps(token_logps_BT, rows.targets, rows.document_ids, rows.documents_per_row)


@dataclass
class PreferenceObjective:
    """`(rows, policy log-probabilities [B, T], cp) -> (loss sum, pairs, statistics' sums)`: the
    trainer's `RowsLoss`, and `prepare`, which gives a LoRA run's micro-batch its reference."""

    dpo: DpoConfig
    lora: bool  # the reference is the model with its adapters off (else dpo.reference must be none)
    statistic_names: tuple[str, ...] = (*STATS, "sft_loss")

    def prepare(self, runner: StepRunner, mb: MicroBatch) -> MicroBatch:
        """`mb` with the reference's log-probabilities of its targets: a full fine-tuning batch carries
        them already (reference_logps.py); a LoRA run's are the runner's forward with every adapter
        off (no gradient; None on a pipeline rank without the last stage, which computes no loss)."""
        if self.dpo.reference == "none" or mb.ref_token_logps is not None:
            return mb
        assert self.lora, "a full fine-tuning reference needs the reference log-probabilities of reference_logps.py"
        with ExitStack() as adapters_off, torch.no_grad():
            for root in runner.roots:
                adapters_off.enter_context(adapters_disabled(root))
            reference = runner.token_logps(mb)
        return mb if reference is None else mb.with_reference(reference)

    def __call__(self, rows: MicroBatch, token_logps_BT: torch.Tensor, cp: int
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(loss sum, pairs, statistics' sums) of packed rows from the policy's log-probabilities of
        all their tokens ([B, T]) and the reference's (`rows.ref_token_logps`); under context
        parallelism (`cp` > 1) the loss sum and pairs are this cp rank's 1/cp share (module docstring)."""
        ref = None
        if self.dpo.reference != "none":
            assert rows.ref_token_logps is not None, "the reference's log-probabilities come with the rows (prepare)"
            ref = _rows_pair_logps(rows.ref_token_logps, rows)
        policy = _rows_pair_logps(token_logps_BT, rows)
        d = self.dpo
        per_pair, stats = preference_loss(
            policy["chosen"], policy["rejected"], ref["chosen"] if ref else None, ref["rejected"] if ref else None,
            chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"], loss=d.loss,
            beta=d.beta, label_smoothing=d.label_smoothing, reference=d.reference, simpo_gamma=d.simpo_gamma)
        sums = {name: stats[name].float().sum() for name in STATS}
        loss_sum = per_pair.sum()
        totals = rows.step_totals
        # The chosen NLL, weighted so that dividing by the step's pairs gives its mean per chosen token.
        sft = -policy["chosen"].sum() * (totals["pairs"] / max(totals["chosen_tokens"], 1))
        sums["sft_loss"] = sft.detach()
        if d.sft_weight:
            loss_sum = loss_sum + d.sft_weight * sft
        pairs = torch.tensor(per_pair.shape[0], device=per_pair.device)
        if cp > 1:  # every cp rank computed the whole loss: each carries 1/cp of it
            loss_sum, pairs = loss_sum / cp, pairs / cp
        return loss_sum, pairs, sums


def preference_summary(val_stats: dict[str, float]) -> str:
    """The validation pairs' accuracy and reward margin as the end of a console line ("" for other
    objectives)."""
    if "val_dpo/accuracy" not in val_stats:
        return ""
    return (f" (validation pairs: preference accuracy {val_stats['val_dpo/accuracy']:.0%}, "
            f"reward margin {val_stats['val_dpo/margin']:.3f})")
