"""`HF_FAMILY`: the `hf` family's torch-free answers (`ModelFamily`, models/common/family.py).

config.json's shapes from args.py, the counts from shapes.py: nothing here imports torch or
transformers, so `glmtune config validate` resolves an `hf` recipe's model in milliseconds.

The family has no presets (a model comes from an HF directory): a preset name is refused by
`ModelFamily.preset_args`, and `model.overrides` (which apply to presets) are refused here.
`hf_model_type` is "*": the family takes any `model_type` transformers implements as a causal
LM that no native family claims (the registry's selection rule).

`LIMITS` are what the family refuses of a recipe at config time (`glmtune config validate` and
`glmtune train`, before anything is allocated): expert, pipeline and context parallelism, GLM-5's
own training settings (MTP and indexer losses, router bias updates, an FP8 base) and GLM-5's kernel
choices, each of which the family would otherwise ignore.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.models.common.family import ModelDims, ModelFamily, SettingLimit
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


_LAYOUT = ("is not available for the hf family (transformers' modules are not laid out for expert, pipeline or "
           "context parallelism); use data parallelism (parallel.dp_shard, parallel.dp_replicate)")
_GLM5_ONLY = "is GLM-5's {what}, which the hf family does not have; remove it or train a GLM-5 checkpoint"
_GLM5_KERNEL = ("chooses how GLM-5's modules compute, which the hf family does not use (transformers' own modules "
                "compute its layers); remove it")

# What the family refuses at config time (`ModelFamily.limits`): every setting it would otherwise
# ignore, each in one sentence naming its key.
LIMITS: tuple[SettingLimit, ...] = (
    ("parallel.ep", (1,), _LAYOUT),
    ("parallel.pp", (1,), _LAYOUT),
    ("parallel.cp", (1,), _LAYOUT),
    ("parallel.activation_checkpointing", ("none", "full"),
     "is not available for the hf family yet (transformers recomputes whole decoder layers); choose none or full"),
    ("train.mtp_loss_weight", (0,), _GLM5_ONLY.format(what="multi-token-prediction loss")),
    ("train.indexer_loss_weight", (0,), _GLM5_ONLY.format(what="DSA indexer loss")),
    ("train.indexer_warmup_steps", (0,), _GLM5_ONLY.format(what="DSA indexer warm-up")),
    ("model.indexer_trainable", (False,), _GLM5_ONLY.format(what="DSA indexer training")),
    ("train.router_bias_update", ("none",), _GLM5_ONLY.format(what="router correction-bias update")),
    ("model.fp8_base", ("none",), _GLM5_ONLY.format(what="frozen FP8 base")),
    ("model.attention_backend", ("auto",), _GLM5_KERNEL),
    ("model.moe_backend", ("grouped_mm",), _GLM5_KERNEL),
    ("model.moe_dispatch_backend", ("auto",), _GLM5_KERNEL),
    ("model.indexer_backend", ("auto",), _GLM5_KERNEL),
    ("model.norm_backend", ("auto",), _GLM5_KERNEL),
    ("model.attention_score_buffer_mib", (1024,), _GLM5_KERNEL),
    ("peft.adapter_kernel", ("auto",), _GLM5_KERNEL),
)

HF_FAMILY = ModelFamily(
    name="hf",
    hf_model_type=ANY_MODEL_TYPE,
    presets={},
    read_args=read_args,
    with_overrides=with_overrides,
    dims=dims,
    stage_costs=stage_costs,
    parameter_count=parameter_count,
    limits=LIMITS,
)
