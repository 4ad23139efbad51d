"""`GLM5_FAMILY`: GLM-5's torch-free answers (`ModelFamily`, models/common/family.py).

Presets and config.json from args.py, the size bound from size_bound.py (a closed-form count,
param_count.py), the pipeline split's costs from stage_costs.py: nothing here imports torch, so
`glmtune config validate` resolves a GLM-5 recipe's model in milliseconds. `GLM5` (spec.py)
answers the same questions through this object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.models.common.family import ModelDims, ModelFamily
from glmtune.models.glm5.args import PRESETS, Glm5Args
from glmtune.models.glm5.param_count import parameter_count
from glmtune.models.glm5.size_bound import check_parameter_count
from glmtune.models.glm5.stage_costs import head_cost, layer_costs


def read_args(path: str | Path) -> Glm5Args:
    """config.json's architecture; refused, naming the file, when it describes more parameters than
    any machine glmtune plans for (the weights, if any, are not read: nothing checks it against them)."""
    args = Glm5Args.from_hf_config(path)
    check_parameter_count(args, Path(path) / "config.json" if Path(path).is_dir() else path)
    return args


def with_overrides(args: Glm5Args, overrides: dict[str, Any]) -> Glm5Args:
    return args.replace(**overrides) if overrides else args


def dims(args: Glm5Args, source: str, overrides: dict[str, Any] | None = None) -> ModelDims:
    """Routed experts and decoder layers after `model.overrides` (each a positive int)."""
    values = {"n_routed_experts": args.n_routed_experts, "num_hidden_layers": args.num_hidden_layers}
    for key in values:
        new = (overrides or {}).get(key)
        if new is not None and (not isinstance(new, int) or isinstance(new, bool) or new < 1):
            raise ValueError(f"model.overrides.{key}: expected a positive int, got {new!r}")
        values[key] = values[key] if new is None else new
    return ModelDims(values["n_routed_experts"], values["num_hidden_layers"], source)


def stage_costs(args: Glm5Args, seq_len: int) -> tuple[list[float], float]:
    return layer_costs(args, seq_len), head_cost(args)


GLM5_FAMILY = ModelFamily(
    name="glm5",
    hf_model_type="glm_moe_dsa",
    presets=PRESETS,
    read_args=read_args,
    with_overrides=with_overrides,
    dims=dims,
    stage_costs=stage_costs,
    parameter_count=parameter_count,
)
