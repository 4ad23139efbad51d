"""`HF_FAMILY`: the `hf` family's torch-free answers (`ModelFamily`, models/common/family.py).

config.json's shapes from args.py, the counts from shapes.py: nothing here imports torch or
transformers, so `glmtune config validate` resolves an `hf` recipe's model in milliseconds.

The family has no presets (a model comes from an HF directory): a preset name is refused by
`ModelFamily.preset_args`, and `model.overrides` (which apply to presets) are refused here.
`hf_model_type` is "*": the family takes any `model_type` transformers implements as a causal
LM that no native family claims (the registry's selection rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.models.common.family import ModelDims, ModelFamily
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.shapes import parameter_count, stage_costs

ANY_MODEL_TYPE = "*"


def read_args(path: str | Path) -> HfArgs:
    """config.json's architecture (the weights, if any, are not read)."""
    return HfArgs.from_hf_config(path)


def with_overrides(args: HfArgs, overrides: dict[str, Any]) -> HfArgs:
    if overrides:
        raise ValueError("model.overrides apply to presets, and the hf family has none; edit the checkpoint's "
                         "config.json instead")
    return args


def dims(args: HfArgs, source: str, overrides: dict[str, Any] | None = None) -> ModelDims:
    """Routed experts (0 for a dense model) and decoder layers; overrides are refused."""
    with_overrides(args, overrides or {})
    return ModelDims(args.num_experts, args.num_hidden_layers, source)


HF_FAMILY = ModelFamily(
    name="hf",
    hf_model_type=ANY_MODEL_TYPE,
    presets={},
    read_args=read_args,
    with_overrides=with_overrides,
    dims=dims,
    stage_costs=stage_costs,
    parameter_count=parameter_count,
)
