"""Step runners: how a micro-batch runs through a built model, whole or as a pipeline's stages.

Everything that runs a model on packed rows (the trainer's steps and validation, a preference
run's reference log-probabilities, `glmtune plan --measure`, eval's in-process scoring) takes the
runner the model family's parallelization built (`Compute.step_runner`) and calls it; none asks
which kind it holds:

    loss_sum, units, stats = runner.train(mb, denominator, rows_loss)   # forward and backward
    loss_sum, units, stats = runner.evaluate(mb, rows_loss)       # forward only
    token_logps_BT = runner.token_logps(mb)                        # [B, T]; None off the last stage
    load = runner.take_expert_load()                               # tokens per expert since the last call

`mb` is the `MicroBatch` of host tensors the trainer built (`microbatch.py`); the runner moves it.
The loss is the model family's next-token loss (`rows_loss` None; its auxiliary losses as `mb.aux`
sizes them: (loss sum, supervised tokens[, statistics' sums])), or another objective's
`RowsLoss`: a function of the rows and their targets' log-probabilities over whole rows (gathered
over the context-parallel ranks), returning (loss sum, units, statistics' sums) — a preference
objective's. `train` backpropagates the loss sum divided by `denominator` (the step's units, a
device tensor; `mb.loss_scale` is its inverse on the host, which the fused loss and a pipeline's
last stage fold into their gradients). Loss sums, units and statistics are this rank's: zeros
on a pipeline rank without the last stage, which sums over the pipeline group complete.

`PlainRunner` (here) runs the whole model in this process (sharded or not); `PipelinedRunner`
(`step_runner_pipelined.py`) drives a pipeline schedule over this rank's stages.

Legend: B rows, S this rank's queries of a row, T tokens of a row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.sequence_shard import SequenceShard

# (model, micro-batch on its device) -> (loss sum, units[, statistics' sums]): a family's next-token loss
FamilyLoss = Callable[[nn.Module, MicroBatch], tuple]
# (model, micro-batch on its device) -> fp32 [B, S] log-probabilities of the targets (0 where -100)
FamilyTokenLogps = Callable[[nn.Module, MicroBatch], torch.Tensor]


class RowsLoss(Protocol):
    """Another objective than next-token: the loss of packed rows from the log-probabilities of
    their targets, e.g. preference pairs (`glmtune/train/preference.py`)."""

    statistic_names: tuple[str, ...]  # the statistics it returns (every rank reduces the same ones)

    def __call__(self, rows: MicroBatch, token_logps_BT: torch.Tensor, cp: int
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss sum, units, statistics' sums) of `rows` (on the device) from `token_logps_BT`, every
        token of the rows; `cp`: the context-parallel ranks computing the same rows (each carries
        1/cp of a loss all of them compute whole)."""


def full_rows(token_logps_BS: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    """[B, T]: every token of the rows from this rank's [B, S] (gathered over the cp group,
    differentiably); itself without context parallelism."""
    if shard is None:
        return token_logps_BS
    return shard.gather(token_logps_BS[..., None])[..., 0]


def _local_identity(t_BT: torch.Tensor) -> torch.Tensor:
    return t_BT


class StepRunner(ABC):
    """Runs micro-batches through a built model (module docstring)."""

    # The modules whose state a forward leaves behind (FSDP2's gathered weights, LoRA switches): the
    # model, and under pipeline parallelism this rank's stages.
    roots: tuple[nn.Module, ...]
    sequence_shard: SequenceShard | None = None  # context parallelism: this rank's queries of each row
    scores_group: Any = None  # the ranks over which `token_logps` is complete when summed (None: this one)

    def local_tokens(self, t_BT: torch.Tensor) -> torch.Tensor:
        """This rank's queries of a per-token tensor of the full rows ([B, T, ...] -> [B, S, ...])."""
        return t_BT if self.sequence_shard is None else self.sequence_shard.local(t_BT)

    @property
    def cp(self) -> int:
        """The context-parallel ranks that compute each row (1: none)."""
        return 1 if self.sequence_shard is None else self.sequence_shard.size

    @abstractmethod
    def train(self, mb: MicroBatch, denominator: torch.Tensor, rows_loss: RowsLoss | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of `mb` (host tensors): (its loss sum, detached; units; statistics' sums)."""

    @abstractmethod
    def evaluate(self, mb: MicroBatch, rows_loss: RowsLoss | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Forward only (call it without gradients): (loss sum, units, statistics' sums)."""

    @abstractmethod
    def token_logps(self, mb: MicroBatch) -> torch.Tensor | None:
        """[B, T] fp32 log-probabilities of `mb`'s targets over whole rows (0 where -100), without
        gradients; None on a rank that does not compute them (a pipeline's, but the last stage's)."""

    @abstractmethod
    def take_expert_load(self) -> dict[str, torch.Tensor]:
        """Tokens routed to each expert of this rank's MoE layers (name -> [experts]) by the training
        forwards since the last call."""


class PlainRunner(StepRunner):
    """The whole model in this process: the family's loss on the device micro-batch, backward of
    loss / denominator, the MoE layers' expert loads read after each training micro-batch.

    Args:
        model: the built (and parallelized) model.
        loss, token_logps: the model family's next-token loss and targets' log-probabilities.
        moe_layers: (name, layer) of the MoE layers the forward routes through (`tokens_per_expert`).
        sequence_shard: the model's context-parallel shard (None: every query is local).
        device: where the micro-batches go (None: the device of the model's parameters).
    """

    def __init__(self, model: nn.Module, loss: FamilyLoss, token_logps: FamilyTokenLogps,
                 moe_layers: list[tuple[str, nn.Module]] = (), sequence_shard: SequenceShard | None = None,
                 device: torch.device | None = None) -> None:
        self.model, self.roots = model, (model,)
        self._loss, self._token_logps = loss, token_logps
        self.moe_layers = list(moe_layers)
        self.sequence_shard = sequence_shard
        self._device = device
        self._load: dict[str, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return self._device
        param = next(self.model.parameters())  # a sharded (DTensor) parameter: its local tensor's device
        return (param.to_local() if hasattr(param, "to_local") else param).device

    def _run(self, mb: MicroBatch, rows_loss: RowsLoss | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        rows = mb.to(self.device)
        if rows_loss is not None:
            return rows_loss(rows, full_rows(self._token_logps(self.model, rows), self.sequence_shard), self.cp)
        loss_sum, units, *stats = self._loss(self.model, rows)
        return loss_sum, units, stats[0] if stats else {}

    def train(self, mb: MicroBatch, denominator: torch.Tensor, rows_loss: RowsLoss | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        loss_sum, units, stats = self._run(mb, rows_loss)
        (loss_sum / denominator).backward()
        for name, module in self.moe_layers:  # after backward: the routing a recompute repeats
            self._load[name] = self._load[name] + module.tokens_per_expert if name in self._load \
                else module.tokens_per_expert.clone()
        return loss_sum.detach(), units, stats

    def evaluate(self, mb: MicroBatch, rows_loss: RowsLoss | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return self._run(mb, rows_loss)

    @torch.no_grad()
    def token_logps(self, mb: MicroBatch) -> torch.Tensor:
        return full_rows(self._token_logps(self.model, mb.to(self.device)).float(), self.sequence_shard)

    def take_expert_load(self) -> dict[str, torch.Tensor]:
        load, self._load = self._load, {}
        return load
