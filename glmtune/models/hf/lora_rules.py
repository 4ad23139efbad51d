"""The hf family's `LoraRules` (models/common/lora_rules.py): a built model is the family's when
it is one of transformers' own models (GLM-5's native model is not one).

With it peft/ describes an hf model's parameters for every run (the inventory of what trains, by
the spec's parameter groups). LoRA itself is refused for the family at config time until its
targets and its stacked MoE experts are covered (`HF_FAMILY.limits`, family.py): no stacked
experts, frozen kinds, absorbed projections or MTP layers are declared here yet.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from glmtune.models.common.lora_rules import LoraRules


class HfLoraRules(LoraRules):
    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, PreTrainedModel)
