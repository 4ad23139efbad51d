"""`MicroBatch`: one micro-batch of packed rows, typed, as everything that runs a model takes it.

The data loader gives a dict of host tensors (`glmtune/train/data_loader.py`'s `collate`); the
trainer builds one `MicroBatch` of it per micro-batch, once (`of_batch`), and hands it to the step
runner (`step_runner.py`), which runs the model family on it. It holds:

  tokens, positions, documents   `input_ids`, `position_ids`, `document_ids` [B, T] (documents:
                                 0, 1, ... per row, -1 padding)
  loss targets                   `targets` [B, T] (the next token; -100: no loss), `mtp_targets`
                                 (the token after next, only when a multi-token-prediction layer runs)
  host facts                     what picks the attention path and sizes the loss without a host
                                 sync (`document_masks`: the longest document, one-document rows),
                                 the supervised targets among this rank's queries, documents per row
  loss weights                   `loss_scale` (what the loss sum is multiplied by before backward:
                                 1 / the step's loss units), the step's unit totals, the auxiliary
                                 losses sized for the step (`aux_loss.AuxiliaryScales`)
  reference log-probabilities    `ref_token_logps` [B, T] fp32 (a full fine-tuning preference run's)
  teacher distributions          `teacher` (`distill_loss.TeacherTopK`: [B, T, K] ids and log-probs,
                                 a [B, T] mask; a distillation run's, packed like the targets)

The host facts are counted on the host before the tensors move (`to`); a pipeline splits a
micro-batch into its microbatches of whole rows (`rows`), each with its own facts.

Legend: B rows, T tokens of a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.distill_loss import TeacherTopK
from glmtune.models.common.document_masks import longest_document, single_document_rows

IGNORE_INDEX = -100
REFERENCE_LOGPS = "ref_token_logps"  # the data loader's key of a preference run's reference, [B, T] fp32
# A distillation run's teacher top-K in a batch (`collate`): [B, T, K] int64 ids, [B, T, K] fp32
# log-probabilities, [B, T] bool mask (`MicroBatch.teacher`, which distill_loss.py reads).
TEACHER_IDS, TEACHER_LOGPS, TEACHER_MASK = "teacher_ids", "teacher_logps", "teacher_mask"
_TENSORS = ("input_ids", "position_ids", "document_ids", "targets", "mtp_targets", "ref_token_logps")


def _identity(t_BT: torch.Tensor) -> torch.Tensor:
    return t_BT


@dataclass(frozen=True)
class MicroBatch:
    """Packed rows and what is known of them on the host (module docstring)."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor | None = None  # [B, T] or [1, T]; None: 0..T-1
    document_ids: torch.Tensor | None = None  # [B, T]; None: split at position restarts
    targets: torch.Tensor | None = None  # [B, T] next-token ids (-100: no loss); None: no loss
    mtp_targets: torch.Tensor | None = None  # [B, T] the tokens after next; None: no MTP layer runs
    longest_document: int | None = None  # document_masks.longest_document (None: the model counts)
    single_document: bool | None = None  # document_masks.single_document_rows (None: the model counts)
    num_supervised: int | None = None  # targets != -100 among this rank's queries (None: the loss counts)
    num_mtp_supervised: int | None = None  # mtp_targets != -100 among this rank's queries
    documents_per_row: tuple[int, ...] | None = None  # documents 0..n-1 of each row (a preference row's pairs)
    loss_scale: float | None = None  # the factor the loss sum is multiplied by before backward, if known
    step_totals: Mapping[str, int] = field(default_factory=dict)  # the step's loss units (its objective's)
    aux: AuxiliaryScales | None = None  # the auxiliary losses, sized for the step (None: none)
    ref_token_logps: torch.Tensor | None = None  # [B, T] fp32 reference log-probabilities of the targets
    teacher: TeacherTopK | None = None  # a distillation run's teacher top-K at the targets (weight 0: unused)

    @classmethod
    def of_batch(cls, batch: Mapping[str, Any], local_tokens: Callable[[torch.Tensor], torch.Tensor] = _identity,
                 loss_scale: float | None = None, step_totals: Mapping[str, int] | None = None,
                 aux: AuxiliaryLosses | None = None, indexer_warmup: bool = False) -> MicroBatch:
        """The micro-batch of the data loader's host batch (`collate`'s keys): its supervised targets
        counted among this rank's queries (`local_tokens`: context parallelism keeps a slice of each
        row's), the auxiliary losses of `aux` sized by `step_totals` (the step's `mtp_tokens` and
        `queries`; a batch on its own: its own), the MTP targets kept only when that loss runs."""
        totals = dict(step_totals or {})
        targets, documents = batch.get("targets"), batch.get("document_ids")
        scales = None
        if aux is not None:
            queries = totals.get("queries")
            if queries is None and aux.indexer_weight > 0:  # a batch on its own
                queries = int((documents >= 0).sum())
            mtp_targets = totals.get("mtp_tokens", batch.get("num_mtp_supervised"))
            scales = AuxiliaryScales(aux, mtp_targets, queries, indexer_warmup)
        mtp = scales is not None and scales.mtp
        return cls(
            input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), document_ids=documents,
            targets=targets, mtp_targets=batch["mtp_targets"] if mtp else None,
            longest_document=batch.get("longest_document"), single_document=batch.get("single_document"),
            num_supervised=_supervised(local_tokens, targets, batch.get("num_supervised")),
            num_mtp_supervised=_supervised(local_tokens, batch["mtp_targets"], batch.get("num_mtp_supervised"))
            if mtp else None,
            documents_per_row=None if documents is None else tuple((documents.max(dim=1).values + 1).tolist()),
            loss_scale=loss_scale, step_totals=totals, aux=scales, ref_token_logps=batch.get(REFERENCE_LOGPS),
            teacher=TeacherTopK.on_host(batch[TEACHER_IDS], batch[TEACHER_LOGPS], batch[TEACHER_MASK], local_tokens)
            if TEACHER_IDS in batch else None)

    def to(self, device: torch.device | str) -> MicroBatch:
        """The micro-batch with its tensors on `device` (its host facts as they are)."""
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in _TENSORS
                 if getattr(self, name) is not None}
        if self.teacher is not None:
            moved["teacher"] = self.teacher.to(device)
        return dataclasses.replace(self, **moved)

    def rows(self, part: slice | list[int], local_tokens: Callable[[torch.Tensor], torch.Tensor] = _identity
             ) -> MicroBatch:
        """Rows `part` (host tensors; a slice, or row indices), with their own host facts (a pipeline's
        microbatch): the longest document, one-document rows, the supervised targets among this rank's
        queries."""
        sliced = {name: getattr(self, name)[part] for name in _TENSORS if getattr(self, name) is not None}
        if self.teacher is not None:
            sliced["teacher"] = self.teacher.rows(part, local_tokens)
        documents, seq_len = sliced["document_ids"], self.input_ids.shape[1]
        picked = range(self.input_ids.shape[0])[part] if isinstance(part, slice) else part
        return dataclasses.replace(
            self, **sliced, longest_document=longest_document(seq_len, document_ids_BS=documents),
            single_document=single_document_rows(seq_len, document_ids_BS=documents),
            num_supervised=_supervised(local_tokens, sliced.get("targets")),
            num_mtp_supervised=_supervised(local_tokens, sliced.get("mtp_targets")),
            documents_per_row=None if self.documents_per_row is None
            else tuple(self.documents_per_row[i] for i in picked))

    def with_reference(self, ref_token_logps_BT: torch.Tensor) -> MicroBatch:
        """The micro-batch carrying these reference log-probabilities of its targets ([B, T] fp32)."""
        return dataclasses.replace(self, ref_token_logps=ref_token_logps_BT)


def _supervised(local_tokens, targets_BT: torch.Tensor | None, counted: int | None = None) -> int | None:
    """Targets != -100 among this rank's queries, on the host (`counted`, the whole rows' count, when
    every query is this rank's)."""
    if targets_BT is None:
        return None
    if local_tokens is _identity and counted is not None:
        return counted
    return int((local_tokens(targets_BT) != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class StageMicrobatch:
    """One pipeline microbatch as a pipeline stage reads it from its queue (`glmtune/distributed/
    pipeline.py`): its rows on the stage's device with their host facts, and another objective's
    loss of them (None: the summed cross-entropy of the targets), which the last stage calls with
    the rows and their targets' log-probabilities (this rank's queries, fp32 [B, S], 0 where -100)."""

    rows: MicroBatch
    token_loss: Callable[[MicroBatch, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
