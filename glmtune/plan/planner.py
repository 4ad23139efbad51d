"""Per-GPU memory of a recipe's layout: the busiest rank of each pipeline stage, walked through
a step (`memory.py`) on the recipe's model built on the meta device (`model_state.py`)."""

from __future__ import annotations

from torch import nn

from glmtune.config import JobConfig
from glmtune.config.degrees import MeshDegrees
from glmtune.config.validate import validate_config
from glmtune.models.registry import model_dims
from glmtune.plan.memory import MemoryPlan, plan_rank_memory
from glmtune.plan.model_state import build_meta_model, rank_state


def degrees_for(cfg: JobConfig, world_size: int | None = None) -> MeshDegrees:
    """The recipe's resolved degrees (validated as `glmtune config validate` does)."""
    dims = model_dims(cfg.model)
    return validate_config(cfg, dims.num_experts, dims.num_layers, world_size, model_refusals=dims.refusals)


def plan_memory(cfg: JobConfig, model: nn.Module | None = None, degrees: MeshDegrees | None = None,
                one_document: bool = True) -> MemoryPlan:
    """The busiest rank's step (the first rank of each pipeline stage is compared)."""
    model = model if model is not None else build_meta_model(cfg)
    degrees = degrees if degrees is not None else _single_or_recipe(cfg)
    stage_size = degrees.world_size // degrees.pp
    plans = [plan_rank_memory(model, cfg, degrees, r, rank_state(model, cfg, degrees, r), one_document)
             for r in range(0, degrees.world_size, stage_size)]
    return max(plans, key=lambda plan: plan.peak.total)


def _single_or_recipe(cfg: JobConfig) -> MeshDegrees:
    p = cfg.parallel
    if p.world_size is None and p.nodes is None:
        return MeshDegrees(1, 1, 1, 1, 1, 1, 1)
    return degrees_for(cfg)
