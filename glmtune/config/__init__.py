"""glmtune's job configuration: a typed dataclass tree loaded from YAML recipes.

    from glmtune.config import load_config, validate_config, model_dims
    cfg = load_config("recipes/tiny/sft_support_json.yaml", ["--train.max_steps=10"])
    dims = model_dims(cfg.model)
    degrees = validate_config(cfg, dims.num_experts, dims.num_layers, world_size=1)
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
from glmtune.config.model_dims import ModelDims, PRESET_DIMS, model_dims
from glmtune.config.schema import (
    CheckpointConfig,
    DEFAULT_LORA_TARGETS,
    DataConfig,
    JobConfig,
    LoggingConfig,
    MODEL_PRESETS,
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
    "resolve_recipe_path", "PRESET_DIMS", "ModelDims", "model_dims", "DEFAULT_LORA_TARGETS", "MODEL_PRESETS",
    "CheckpointConfig", "DataConfig", "JobConfig", "LoggingConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "PeftConfig", "SyntheticDataConfig", "TrainConfig", "MeshDegrees", "grad_accum_steps",
    "pipeline_microbatches", "resolve_world_size", "validate_config", "validate_parallel",
]
