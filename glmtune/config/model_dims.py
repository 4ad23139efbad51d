"""The two model dimensions config validation needs: routed experts and decoder layers.

Kept apart from the model code so `glmtune config validate` runs on a laptop with no
weights and no model import. The preset table must agree with the model presets
(GLM-5/5.1/5.2/5.3 config.json: n_routed_experts 256, num_hidden_layers 78).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glmtune.config.schema import MODEL_PRESETS, ModelConfig


@dataclass(frozen=True)
class ModelDims:
    num_experts: int  # routed experts per MoE layer (config.json `n_routed_experts`)
    num_layers: int  # decoder layers, MTP excluded (config.json `num_hidden_layers`)
    source: str  # where the numbers came from, for messages


PRESET_DIMS: dict[str, tuple[int, int]] = {
    "tiny": (8, 4),
    "glm5": (256, 78),
    "glm5.1": (256, 78),
    "glm5.2": (256, 78),
    "glm5.3": (256, 78),
}
assert set(PRESET_DIMS) == set(MODEL_PRESETS)


def model_dims(model: ModelConfig) -> ModelDims:
    """Dims of `model.name_or_path` (a preset or an HF directory), after `model.overrides`.

    A directory that does not exist yet (a recipe's `/path/to/GLM-5` placeholder) falls
    back to `model.validate_as`; without it, that is an error.
    """
    name = model.name_or_path
    if name in PRESET_DIMS:
        experts, layers = PRESET_DIMS[name]
        source = f"preset {name}"
    elif (Path(name) / "config.json").is_file():
        experts, layers = _read_hf_config(Path(name) / "config.json")
        source = f"{name}/config.json"
    elif model.validate_as is not None:
        experts, layers = PRESET_DIMS[model.validate_as]
        source = f"preset {model.validate_as} (model.validate_as; {name} not found)"
    else:
        raise ValueError(
            f"model.name_or_path: {name!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a directory "
            "with config.json; set model.validate_as to a preset to validate without the weights"
        )
    # Overrides such as fewer layers for a smoke test change what the parallel plan must fit.
    experts = _override_int(model, "n_routed_experts", experts)
    layers = _override_int(model, "num_hidden_layers", layers)
    return ModelDims(experts, layers, source)


def _read_hf_config(path: Path) -> tuple[int, int]:
    config = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("n_routed_experts", "num_hidden_layers") if not isinstance(config.get(k), int)]
    if missing:
        raise ValueError(f"{path}: missing integer key(s) {', '.join(missing)}; is this a GLM-5 (glm_moe_dsa) model?")
    return config["n_routed_experts"], config["num_hidden_layers"]


def _override_int(model: ModelConfig, key: str, value: int) -> int:
    if key not in model.overrides:
        return value
    new = model.overrides[key]
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise ValueError(f"model.overrides.{key}: expected a positive int, got {new!r}")
    return new


def model_args(model: ModelConfig):
    """The full architecture (`Glm5Args`) `model` names, without reading weights or importing torch:
    a preset (after `model.overrides`), an HF directory's config.json, or `model.validate_as`
    for a placeholder path. The pipeline split is planned from it."""
    # torch-free (args only); an import of the model family from config/: the model spec's to own
    from glmtune.models.glm5.args import PRESETS, get_preset, resolve_args

    name = model.name_or_path
    if name not in PRESETS and not Path(name).exists() and model.validate_as is not None:
        name = model.validate_as  # a placeholder path: the preset the recipe validates as
    if name in PRESETS:
        args = get_preset(name)
        return args.replace(**model.overrides) if model.overrides else args
    if model.overrides:
        raise ValueError("model.overrides apply to presets only; edit the checkpoint's config.json instead")
    return resolve_args(name)
