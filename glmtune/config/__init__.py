"""glmtune's job configuration: a typed dataclass tree loaded from YAML recipes.

    from glmtune.config import load_config, validate_config
    cfg = load_config("recipes/tiny/sft_support_json.yaml", ["--train.max_steps=10"])
    degrees = validate_config(cfg, num_experts=8, num_layers=4, world_size=1)

The model's experts and layers come from its family (`glmtune.models.registry.model_dims`):
config/ knows no model.
"""

from glmtune.config.loader import (
    RECIPES_DIR,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    dump_config,
    load_config,
    load_run_config,
    resolve_recipe_path,
)
from glmtune.config.schema import (
    CheckpointConfig,
    DataConfig,
    DpoConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PeftConfig,
    SyntheticDataConfig,
    TrainConfig,
)
from glmtune.config.validate import (
    MeshDegrees,
    grad_accum_steps,
    pipeline_microbatches,
    resolve_world_size,
    validate_config,
    validate_parallel,
)

__all__ = [
    "RECIPES_DIR", "config_from_dict", "config_to_dict", "config_to_yaml", "dump_config", "load_config", "load_run_config",
    "resolve_recipe_path",
    "CheckpointConfig", "DataConfig", "DpoConfig", "JobConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "PeftConfig", "SyntheticDataConfig", "TrainConfig", "MeshDegrees", "grad_accum_steps",
    "pipeline_microbatches", "resolve_world_size", "validate_config", "validate_parallel",
]
