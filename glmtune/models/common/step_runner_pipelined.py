"""`PipelinedRunner`: the step runner (`step_runner.py`) of a model split into pipeline stages.

The model family's parallelization splits the model and builds the pipeline
(`glmtune/distributed/pipeline.py`'s `Pipeline`: this rank's stages and their schedule); this
runner drives it with the trainer's micro-batches. The pipeline cuts each micro-batch into its
microbatches of whole rows and the schedule runs forward and backward per microbatch; the last
stage computes each microbatch's loss, multiplied by `mb.loss_scale` (so gradients add up over
microbatches, micro-batches and ranks as in one process; `train`'s `denominator` is its device
twin, which this runner does not need). Another objective's `RowsLoss` is called by the last stage
with each microbatch's rows and their targets' log-probabilities (gathered into whole rows under
context parallelism); its units and statistics are summed here. Loss sums, units and statistics
are this rank's last stages' (zeros elsewhere, every rank naming the same statistics); the
log-probabilities of `token_logps` only the last stage's rank has (`scores_group` sums them).

This module imports no pipeline: it relies on `Pipeline`'s members (`stages`, `device`, `group`,
`has_last`, `train_step`, `evaluate`, `take_statistics`) and the stages' `expert_load`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import RowsLoss, StepRunner, full_rows


class PipelinedRunner(StepRunner):
    """`pipeline`'s stages run each micro-batch (module docstring); `model` the pruned model they share."""

    def __init__(self, pipeline: Any, model: nn.Module) -> None:
        self.pipeline = pipeline
        self.roots = (model, *pipeline.stages)
        self.device = pipeline.device
        self.sequence_shard = pipeline.stages[0].sequence_shard  # every stage shares the model's
        self.scores_group = pipeline.group

    def train(self, mb: MicroBatch, denominator: torch.Tensor, rows_loss: RowsLoss | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if rows_loss is None:  # the stages' own losses (the next-token loss, its auxiliary ones)
            loss_sum, count = self.pipeline.train_step(mb)
            return loss_sum, count, self.pipeline.take_statistics()
        scored: list[tuple[torch.Tensor, dict]] = []
        loss_sum, _ = self.pipeline.train_step(mb, self._scorer(rows_loss, scored))
        units, stats = self._totals(rows_loss, scored)
        return loss_sum, units, stats

    def evaluate(self, mb: MicroBatch, rows_loss: RowsLoss | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if rows_loss is None:
            loss_sum, count = self.pipeline.evaluate(mb)
            return loss_sum, count, self.pipeline.take_statistics()
        scored: list[tuple[torch.Tensor, dict]] = []
        loss_sum, _ = self.pipeline.evaluate(mb, self._scorer(rows_loss, scored))
        units, stats = self._totals(rows_loss, scored)
        return loss_sum, units, stats

    @torch.no_grad()
    def token_logps(self, mb: MicroBatch) -> torch.Tensor | None:
        """As `StepRunner.token_logps`; a micro-batch of fewer rows than the pipeline's is filled with
        its rows repeated (the stages' shapes are fixed), each row's values its last copy's."""
        num_rows, full = mb.input_ids.shape[0], self.pipeline.micro_batch
        filled = list(range(full)) if num_rows == full else [b % num_rows for b in range(full)]
        scores: list[torch.Tensor] = []

        def keep(rows: MicroBatch, token_logps_BS: torch.Tensor) -> torch.Tensor:
            scores.append(full_rows(token_logps_BS.float(), self.sequence_shard))
            return token_logps_BS.new_zeros(())

        self.pipeline.evaluate(mb if num_rows == full else mb.rows(filled), keep)
        if not self.pipeline.has_last:
            return None
        last_copy = [max(b for b in range(full) if filled[b] == i) for i in range(num_rows)]
        return torch.cat(scores)[last_copy]

    def take_expert_load(self) -> dict[str, torch.Tensor]:
        load: dict[str, torch.Tensor] = {}
        for stage in self.pipeline.stages:
            load.update(stage.expert_load)
            stage.expert_load = {}
        return load

    def _scorer(self, rows_loss: RowsLoss, scored: list):
        """The last stage's loss of each microbatch: `rows_loss` of its rows, whose units and
        statistics are kept in `scored`."""
        def score(rows: MicroBatch, token_logps_BS: torch.Tensor) -> torch.Tensor:
            loss_sum, units, stats = rows_loss(rows, full_rows(token_logps_BS, self.sequence_shard), self.cp)
            scored.append((units, stats))
            return loss_sum
        return score

    def _totals(self, rows_loss: RowsLoss, scored: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The microbatches' units and statistics summed, each a tensor of its own (zeros on a rank
        without the last stage)."""
        def total(values) -> torch.Tensor:
            return sum(values, torch.zeros((), device=self.device))

        return total(u for u, _ in scored), {name: total(s[name] for _, s in scored)
                                             for name in rows_loss.statistic_names}
