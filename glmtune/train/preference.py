"""The preference objective (`train.objective: dpo`) as the trainer sees it: a loss function and
its units.

A micro-batch is packed preference rows: in each row documents 2i and 2i+1 are the chosen and
rejected answers of pair i, a pair never split across rows (`glmtune/data/packing.py`). The loss
function runs the model once for the policy's per-token log-probabilities and, for a LoRA run's
reference, once more with the adapters switched off under no_grad (the starting model, no second
copy of the weights); a full fine-tuning run's reference comes with the batch (`ref_token_logps`,
computed before training by `reference_logps.py`); `dpo.reference: none` (SimPO) has no
reference. Sequence log-probabilities are sums over each completion's supervised tokens
(`preference_loss.pair_logps`).

The trainer divides each micro-batch's loss sum by the step's pairs (over its micro-batches and
data-parallel ranks), so the update is the mean over the step's pairs, as TRL's over its batch;
the SFT term (`dpo.sft_weight`) is a mean over the step's chosen tokens, so the loss sum carries it
as `pairs of the step / chosen tokens of the step` × the micro-batch's chosen NLL.

Layouts:
  * Context parallelism: a cp rank's forward gives the log-probabilities of its slice of each
    row's tokens. They are gathered into the full rows first (the model's own differentiable
    `sequence_shard.gather`, `glmtune/distributed/context_parallel.py`), so every cp rank sums
    each document over all its tokens, in the one-process order, and computes the same pair
    losses from the host's full `targets` and `document_ids` (the same document slots on every
    rank). The gather's backward sums the cp ranks' row gradients: with each rank backpropagating
    the whole loss, every token's gradient would be cp times the one-process one, so each rank
    returns 1/cp of the loss sum (and of the pair count): summed over the cp ranks — the
    gradients by FSDP2's reduction over dp_shard x cp, the logged loss by the trainer's all-reduce
    — they count once. The statistics are not divided: the trainer sums them over the
    data-parallel ranks only (cp ranks share rows).
  * Pipeline parallelism: the trainer hands the `Pipeline` instead of the model; the last stage
    turns each pipeline microbatch's hidden states into the targets' log-probabilities and calls
    this objective's loss of those rows (`MicrobatchFacts.token_loss`). Pipeline microbatches are
    whole rows, so a pair never splits across them. The LoRA reference is a forward-only pass
    through the pipeline with the adapters off, before the schedule's step on the same rows. Loss
    sums, pairs and statistics are the last stage's (zeros on other stages): the trainer sums them
    over the pipeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from glmtune.config import DpoConfig
from glmtune.distributed.pipeline import Pipeline
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.peft.lora import adapters_disabled
from glmtune.train.data_loader import REFERENCE_CACHE  # a full fine-tuning run's reference: [B, T] fp32
from glmtune.train.preference_loss import pair_logps, preference_loss

# Per-pair statistics the trainer logs (as dpo/<name>, means over the step's pairs).
STATS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy", "logps_chosen", "logps_rejected")
_ROW_KEYS = ("targets", "document_ids", REFERENCE_CACHE)  # per-token tensors the pair losses read


def pair_counts(batch: dict[str, Any]) -> dict[str, int]:
    """The step totals the preference loss needs, from a micro-batch's host tensors: its pairs
    (the loss's unit) and its chosen answers' supervised tokens (the SFT term's)."""
    documents = batch["document_ids"]
    chosen = (batch["targets"] != IGNORE_INDEX) & (documents >= 0) & (documents % 2 == 0)
    return {"pairs": int(((documents.max(dim=1).values + 1) // 2).sum()), "chosen_tokens": int(chosen.sum())}


def documents_per_row(batch: dict[str, Any], step: int = 0) -> dict[str, Any]:
    """Host fact for the loss: the number of documents of each row (ids 0..n-1, padding -1); the
    step (TrainerSettings.host_facts' second argument) does not matter here."""
    return {"documents_per_row": (batch["document_ids"].max(dim=1).values + 1).tolist()}


def sequence_shard_of(module: nn.Module) -> SequenceShard | None:
    """The context-parallel shard of a model (on its core `model.model`) or of a pipeline stage:
    context_parallel.py's interface; None when every token is local."""
    return getattr(getattr(module, "model", module), "sequence_shard", None)


def full_rows(token_logps_BS: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """[B, T]: every token of the rows from this rank's [B, S] (gathered over the cp group,
    differentiably); itself without context parallelism."""
    if shard is None:
        return token_logps_BS
    return shard.gather(token_logps_BS[..., None])[..., 0]


def _rows_pair_logps(token_logps_BT: torch.Tensor, rows: dict[str, Any]) -> dict[str, torch.Tensor]:
    return pair_logps(token_logps_BT, rows["targets"], rows["document_ids"], rows["documents_per_row"])


@dataclass
class PreferenceObjective:
    """`loss(model, batch) -> (loss sum, pairs, statistics' sums)` for the trainer."""

    token_logps: Callable[[nn.Module, dict[str, Any]], torch.Tensor]  # the model family's spec.token_logps
    dpo: DpoConfig
    lora: bool  # the reference is the model with its adapters off (else dpo.reference must be none)

    def reference_logps(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """The reference's per-pair sums of `batch`'s rows (None for SimPO): the cached ones a full
        fine-tuning batch carries, else the adapters-off model's."""
        if self.dpo.reference == "none":
            return None
        if REFERENCE_CACHE in batch:  # full fine-tuning: computed before training (reference_logps.py)
            return _rows_pair_logps(batch[REFERENCE_CACHE], batch)
        assert self.lora, "a full fine-tuning reference needs the reference log-probabilities of reference_logps.py"
        with torch.no_grad(), adapters_disabled(model):
            token_logps = self.token_logps(model, batch)
        return _rows_pair_logps(full_rows(token_logps, sequence_shard_of(model)), batch)

    def loss(self, model: nn.Module | Pipeline, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if isinstance(model, Pipeline):
            return self.pipeline_loss(model, batch)
        ref = self.reference_logps(model, batch)
        shard = sequence_shard_of(model)
        return self.rows_loss(full_rows(self.token_logps(model, batch), shard), batch, ref, shard)

    def rows_loss(self, token_logps_BT: torch.Tensor, rows: dict[str, Any], ref: dict[str, torch.Tensor] | None,
                  shard: SequenceShard | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(loss sum, pairs, statistics' sums) of packed rows from the policy's log-probabilities of
        all their tokens ([B, T]) and the reference's pair sums; under context parallelism
        (`shard`) the loss sum and pairs are this cp rank's 1/cp share (module docstring)."""
        policy = _rows_pair_logps(token_logps_BT, rows)
        d = self.dpo
        per_pair, stats = preference_loss(
            policy["chosen"], policy["rejected"], ref["chosen"] if ref else None, ref["rejected"] if ref else None,
            chosen_tokens=policy["chosen_tokens"], rejected_tokens=policy["rejected_tokens"], loss=d.loss,
            beta=d.beta, label_smoothing=d.label_smoothing, reference=d.reference, simpo_gamma=d.simpo_gamma)
        sums = {name: stats[name].float().sum() for name in STATS}
        loss_sum = per_pair.sum()
        totals = rows["step_totals"]
        # The chosen NLL, weighted so that dividing by the step's pairs gives its mean per chosen token.
        sft = -policy["chosen"].sum() * (totals["pairs"] / max(totals["chosen_tokens"], 1))
        sums["sft_loss"] = sft.detach()
        if d.sft_weight:
            loss_sum = loss_sum + d.sft_weight * sft
        pairs = torch.tensor(per_pair.shape[0], device=per_pair.device)
        if shard is not None:  # every cp rank computed the whole loss: each carries 1/cp of it
            loss_sum, pairs = loss_sum / shard.size, pairs / shard.size
        return loss_sum, pairs, sums

    # -- pipeline parallelism -------------------------------------------------------------
    def pipeline_loss(self, pipeline: Pipeline, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One micro batch (host tensors) through `pipeline`: its schedule's forward and backward
        when gradients are enabled, a forward only otherwise (validation). The last stage scores
        each pipeline microbatch's rows (`rows_loss`); the reference goes first, for the same rows.
        Returns this rank's last stages' sums (zeros on a rank without the last stage)."""
        parts = pipeline.row_slices(batch["input_ids"].shape[0])
        rows = [self._microbatch_rows(batch, part, pipeline.device) if pipeline.has_last else None
                for part in parts]
        shard = sequence_shard_of(pipeline.stages[0])  # every stage of a rank shares the model's shard
        refs = self._pipeline_reference(pipeline, batch, rows, shard)
        scored: list[tuple[torch.Tensor, dict]] = []
        losses = [functools.partial(self._record_loss, scored, mb_rows, ref, shard) for mb_rows, ref in zip(rows, refs)]
        if torch.is_grad_enabled():
            loss_sum = pipeline.train_step(batch, batch["loss_grad_scale"], token_losses=losses)
        else:
            loss_sum, _ = pipeline.evaluate(batch, token_losses=losses)
        def total(values) -> torch.Tensor:  # a tensor of its own per total, zero without the last stage
            return sum(values, torch.zeros((), device=pipeline.device))

        return loss_sum, total(p for p, _ in scored), {name: total(s[name] for _, s in scored)
                                                       for name in (*STATS, "sft_loss")}

    def _microbatch_rows(self, batch: dict[str, Any], part: slice, device: torch.device) -> dict[str, Any]:
        """The per-token tensors, documents per row and step totals of one pipeline microbatch's rows."""
        rows = {key: batch[key][part].to(device) for key in _ROW_KEYS if key in batch}
        return dict(rows, documents_per_row=batch["documents_per_row"][part], step_totals=batch["step_totals"])

    def _record_loss(self, scored: list, rows: dict[str, Any], ref: dict | None, shard: SequenceShard | None,
                     token_logps_BS: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one microbatch (`MicrobatchFacts.token_loss`); its pairs and
        statistics are kept in `scored`."""
        loss_sum, pairs, sums = self.rows_loss(full_rows(token_logps_BS, shard), rows, ref, shard)
        scored.append((pairs, sums))
        return loss_sum

    def _pipeline_reference(self, pipeline: Pipeline, batch: dict[str, Any], rows: list, shard) -> list:
        """Each microbatch's reference pair sums on the last stage's rank (None elsewhere, and for
        SimPO): the cache's, or one forward-only pass of the whole micro batch through the pipeline
        with every stage's adapters off (every pp rank takes part)."""
        if self.dpo.reference == "none":
            return [None] * len(rows)
        if REFERENCE_CACHE in batch:
            return [_rows_pair_logps(r[REFERENCE_CACHE], r) if r is not None else None for r in rows]
        assert self.lora, "a full fine-tuning reference needs the reference log-probabilities of reference_logps.py"
        refs: list = [None] * len(rows)

        def keep(m: int, token_logps_BS: torch.Tensor) -> torch.Tensor:
            refs[m] = _rows_pair_logps(full_rows(token_logps_BS, shard), rows[m])
            return token_logps_BS.new_zeros(())

        with ExitStack() as adapters_off, torch.no_grad():
            for stage in pipeline.stages:
                adapters_off.enter_context(adapters_disabled(stage))
            pipeline.evaluate(batch, token_losses=[functools.partial(keep, m) for m in range(len(rows))])
        return refs


def preference_summary(val_stats: dict[str, float]) -> str:
    """The validation pairs' accuracy and reward margin as the end of a console line ("" for other
    objectives)."""
    if "val_dpo/accuracy" not in val_stats:
        return ""
    return (f" (validation pairs: preference accuracy {val_stats['val_dpo/accuracy']:.0%}, "
            f"reward margin {val_stats['val_dpo/margin']:.3f})")
