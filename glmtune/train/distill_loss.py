"""The distillation objective (`train.objective: distill`) as the trainer sees it.

Its loss is the model family's next-token loss on the teacher's answers (sequence-level
distillation: SFT's loss on the same rows, the same unit: the step's supervised tokens) plus
λ (`distill.weight`) times the KL between the teacher's top-K distribution and the student's at
temperature T (`distill.temperature`), summed over the positions whose top-K the rows carry
(`distill_data.py`) and divided by the same supervised tokens. The family computes the KL in its
own loss path, from the forward's final hidden states and its head (`Glm5Compute.loss`, models/common/
distill_loss.py); the trainer's part is only to give each micro-batch λ and T (`prepare`) and to
log the two parts as distill/ce and distill/kl (per supervised token). With λ = 0 the micro-batches
carry no teacher and the run is SFT's, bit for bit.
"""

from __future__ import annotations

import dataclasses

from glmtune.config.schema import DistillConfig
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import StepRunner
from glmtune.train.trainer import TrainerSettings


@dataclasses.dataclass(frozen=True)
class DistillWeights:
    """The trainer's `prepare`: the micro-batch's teacher given the run's λ and temperature."""

    weight: float
    temperature: float

    def __call__(self, runner: StepRunner, mb: MicroBatch) -> MicroBatch:
        if mb.teacher is None:
            return mb
        teacher = dataclasses.replace(mb.teacher, weight=self.weight, temperature=self.temperature)
        return dataclasses.replace(mb, teacher=teacher)


def distill_settings(distill: DistillConfig, settings: TrainerSettings) -> TrainerSettings:
    """The trainer settings of `train.objective: distill` (module docstring)."""
    if distill.weight == 0:  # sequence-level: SFT's loss on the teacher's rows, nothing added
        return settings
    return dataclasses.replace(settings, prepare=DistillWeights(distill.weight, distill.temperature),
                               stats_prefix="distill/")
