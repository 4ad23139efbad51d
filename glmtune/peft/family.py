"""The family of a built model, for peft/: the spec whose LoRA hooks (`ModelSpec.lora`) own it.

peft/ reaches a model family only through its spec (tests/test_layout.py): the parameter groups
(`param_group`, `param_groups`), the HF names (`state_dict_adapter`) and the LoRA hooks
(`lora`, models/common/lora_rules.py) of the family the model belongs to.
"""

from __future__ import annotations

from torch import nn

from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import SPECS


def spec_of(model: nn.Module) -> ModelSpec:
    """The spec of the family `model` (a built causal LM, sharded or not) belongs to."""
    for spec in SPECS.values():
        if spec.lora is not None and spec.lora.owns(model):
            return spec
    raise ValueError(f"{type(model).__name__} is no model of a family glmtune adapts with LoRA "
                     f"({', '.join(SPECS)})")


def hf_prefix(model: nn.Module):
    """internal module name -> its name on disk (an MTP layer's modules: `model.layers.{L + j}`),
    the family's state-dict adapter's."""
    spec = spec_of(model)
    return spec.state_dict_adapter(spec.args_of(model)).hf_prefix


def internal_prefix(model: nn.Module):
    """name on disk -> the module's internal name (the inverse of `hf_prefix`), the family's
    state-dict adapter's."""
    spec = spec_of(model)
    return spec.state_dict_adapter(spec.args_of(model)).internal_prefix
