"""`MicrobatchFacts`: what is known on the host about one microbatch of packed rows.

A model's forward picks its attention path and sizes its loss from a few facts about the
rows (longest document, whether every row is one document, supervised targets). Counted
on the device they cost a host sync each, which stalls the launch queue; counted on the
host from the data loader's batch they are free. Whoever splits a batch into microbatches
(the pipeline, `glmtune/distributed/pipeline.py`) builds one per microbatch and queues it
for the model's stages; the stages read them in order. An auxiliary loss the last stage adds
(multi-token prediction) is sized the same way: its own supervised count and gradient factor; so is
one every stage adds (the indexer KL): its gradient factor.

Legend: B rows of the microbatch, T tokens of a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from glmtune.models.common.document_masks import longest_document, single_document_rows


@dataclass(frozen=True)
class MicrobatchFacts:
    """Host-side facts of one microbatch's rows (`document_masks.longest_document`, `single_document_rows`)."""

    longest: int
    single_document: bool
    supervised: int | None = None  # targets != -100 among this rank's queries (None: counted on the device)
    loss_scale: float | None = None  # the last stage returns loss_sum x this (1 / the step's supervised tokens)
    # Another objective's loss sum of these rows from the targets' log-probabilities (this rank's
    # queries, fp32 [B, S], 0 where -100), e.g. preference pairs; None: the summed cross-entropy.
    token_loss: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    # A multi-token-prediction loss of these rows (the last stage's, when it runs one): its targets
    # != -100 among this rank's queries, and the factor its sum is differentiated with (the loss
    # weight / the step's MTP targets over every rank; None: forward only).
    mtp_supervised: int | None = None
    mtp_grad_scale: float | None = None
    # An indexer KL loss of these rows (every stage's layers compute one): the factor each layer's KL
    # sum is differentiated with (the loss weight / (the step's non-padding queries over every rank x
    # the layers computing a KL); None: reported only, or no KL).
    indexer_grad_scale: float | None = None

    @classmethod
    def of_rows(cls, document_ids_BT: torch.Tensor, supervised: int | None = None,
                loss_scale: float | None = None, token_loss=None, mtp_supervised: int | None = None,
                mtp_grad_scale: float | None = None, indexer_grad_scale: float | None = None) -> MicrobatchFacts:
        """The facts of rows with documents `document_ids_BT` (host tensor [B, T])."""
        seq_len = document_ids_BT.shape[1]
        return cls(longest_document(seq_len, document_ids_BS=document_ids_BT),
                   single_document_rows(seq_len, document_ids_BS=document_ids_BT), supervised, loss_scale,
                   token_loss, mtp_supervised, mtp_grad_scale, indexer_grad_scale)
