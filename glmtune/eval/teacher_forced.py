"""The batches `glmtune eval` scores teacher-forced, and how a model of any family scores them.

The reference loss, the general text loss, the serving metrics and the preference pairs all run
the model over known tokens, not generated ones. Each is a packed batch as training's `collate`
makes one (one document per row here, or a preference pair's two documents), on the model's
device, scored by the model family as training's typed micro-batch (`MicroBatch.of_batch`; the
loss and token log-probabilities through the spec's step runner, `backends.LocalModel`) or as the
batch itself (`Compute.serving_metrics`): so a model is scored as its training scores it,
whatever its family's forward looks like.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from glmtune.models.common.microbatch import MicroBatch
from glmtune.train.data_loader import collate


def one_document(ids: list[int], labels: list[int]) -> dict[str, Any]:
    """`ids` as a one-row, one-document packed batch; `labels` the token itself where it is
    supervised, -100 elsewhere (`collate` turns them into next-token targets)."""
    return collate([{"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids))),
                     "document_ids": [0] * len(ids)}])


def on_model_device(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """`batch`'s tensors moved to the device the model's parameters live on."""
    device = next(model.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def micro_batch(model: nn.Module, batch: dict[str, Any]) -> MicroBatch:
    """`batch` as the typed micro-batch the family's `loss` and `token_logps` take, on the model's device."""
    return MicroBatch.of_batch(batch).to(next(model.parameters()).device)


@torch.no_grad()
def summed_loss(model: nn.Module, loss: Callable, batch: dict[str, Any]) -> tuple[float, int]:
    """(summed next-token loss, supervised tokens) of `batch` under `model` (`loss(model, mb)`: the
    family's loss of a micro-batch)."""
    loss_sum, count = loss(model, micro_batch(model, batch))[:2]
    return float(loss_sum), int(count)
