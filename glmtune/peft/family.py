"""The family of a built model, for peft/: the spec whose LoRA hooks (`ModelSpec.lora`) own it.

peft/ reaches a model family only through its spec (tests/test_layout.py): the parameter groups
(`param_group`, `param_groups`), the HF names (`state_dict_adapter`) and the LoRA hooks
(`lora`, models/common/lora_rules.py) of the family the model belongs to.
"""

from __future__ import annotations

from collections.abc import Callable

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


def hf_prefix(model: nn.Module) -> Callable[[str], str]:
    """internal module name -> its name in an adapter file (an MTP layer's modules: `model.layers.{L + j}`):
    the family's LoRA hooks' (`adapter_names`), else its state-dict adapter's."""
    spec = spec_of(model)
    names = spec.lora.adapter_names(model)
    return names[0] if names is not None else _adapter(spec, model).hf_prefix


def internal_prefix(model: nn.Module) -> Callable[[str], str]:
    """name in an adapter file -> the module's internal name (the inverse of `hf_prefix`)."""
    spec = spec_of(model)
    names = spec.lora.adapter_names(model)
    return names[1] if names is not None else _adapter(spec, model).internal_prefix


def _adapter(spec: ModelSpec, model: nn.Module):
    """The family's state-dict adapter for the built `model` (the only place HF key names live)."""
    return spec.weights.state_dict_adapter(spec.architecture.args_of(model))
