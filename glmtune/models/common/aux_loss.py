"""Auxiliary losses that ride on the main loss's backward pass.

A model's auxiliary losses (GLM-5's multi-token prediction, the DSA indexer's KL) are
computed deep inside its forward, under activation checkpointing, FSDP units and pipeline
stages that only ever see the main loss. `attach` hands such a loss to autograd without
changing any value: it returns `carrier` unchanged, and in backward passes the carrier's
gradient on and gives the auxiliary loss a gradient of exactly `grad_scale` (the weight
divided by the step's normalizer, known on the host before the step). The auxiliary graph
is then differentiated in the same backward as the main loss, whatever the caller does with
the carrier (divides it, sums it over microbatches, sends it through a pipeline schedule).

The gradient of the auxiliary loss does not depend on the carrier's: the caller's factor
for the main loss (1 / its supervised tokens) never leaks into the auxiliary one.

`AuxiliaryScales` sizes a micro-batch's auxiliary losses for its step (the weights, the step's
totals) and computes their gradient factors, here and nowhere else: the trainer builds one per
micro-batch (`MicroBatch.aux`), and a model run whole or as pipeline stages reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AuxiliaryLosses:
    """The weights of a run's auxiliary losses (0: off): `train.mtp_loss_weight`, `train.indexer_loss_weight`."""

    mtp_weight: float = 0.0
    indexer_weight: float = 0.0


@dataclass(frozen=True)
class AuxiliaryScales:
    """A micro-batch's auxiliary losses sized for its step (`MicroBatch.aux`): their weights, the
    step's totals over its micro-batches and every data-parallel rank (None: not known, as for a
    batch evaluated on its own: the losses are then computed without a gradient factor), and whether
    the step is one of the indexer warm-up's (dense attention, only the indexers train)."""

    losses: AuxiliaryLosses = AuxiliaryLosses()
    mtp_targets: int | None = None  # the step's supervised multi-token-prediction targets
    queries: int | None = None  # the step's non-padding queries (the indexer KL's unit)
    indexer_warmup: bool = False

    @property
    def mtp(self) -> bool:
        """The multi-token-prediction loss runs."""
        return self.losses.mtp_weight > 0

    @property
    def indexer(self) -> bool:
        """The indexers' KL loss runs."""
        return self.losses.indexer_weight > 0

    def mtp_grad_scale(self) -> float | None:
        """The factor the MTP loss sum is differentiated with: its weight / the step's MTP targets,
        so that it is a mean over them (None: forward only)."""
        if not self.mtp or self.mtp_targets is None:
            return None
        return self.losses.mtp_weight / max(int(self.mtp_targets), 1)

    def indexer_grad_scale(self, kl_layers: int) -> float | None:
        """The factor each layer's indexer KL sum is differentiated with: its weight / (the step's
        queries x `kl_layers`, the model's layers computing a KL), a mean over both (None: the KL is
        reported only)."""
        if not self.indexer or self.queries is None:
            return None
        return self.losses.indexer_weight / max(self.queries * kl_layers, 1)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, aux_loss, grad_scale):
        ctx.grad_scale = grad_scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad_carrier):
        grad_aux = torch.full(ctx.aux_shape, ctx.grad_scale, dtype=ctx.aux_dtype, device=grad_carrier.device)
        return grad_carrier, grad_aux, None


def attach(carrier: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """`carrier`, unchanged, whose backward also backpropagates `aux_loss` with gradient `grad_scale`.

    Without gradients, or when `aux_loss` has no graph, `carrier` itself.
    """
    if not torch.is_grad_enabled() or not aux_loss.requires_grad:
        return carrier
    return _Attach.apply(carrier, aux_loss, float(grad_scale))
