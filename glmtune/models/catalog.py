"""The model families glmtune knows, and what a recipe's `model` section names: without torch.

`FAMILIES` lists each family's torch-free answers (`ModelFamily`, models/common/family.py);
`family_for(name_or_path)` is the family of a preset name or an HF directory (by its
config.json `model_type`); `model_args` and `model_dims` resolve a recipe's model section
(after `model.overrides`, or `model.validate_as` for a placeholder path) from config.json
alone. `glmtune config validate` and `--help` stop here, and so never import torch; the
runtime side (the `ModelSpec` of each family, an HF directory read with its weights checked
against config.json) is the registry (registry.py), which passes that reader in as `read_hf`.
A second family is one more entry in `FAMILIES` (and its spec in the registry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glmtune.config.schema import ModelConfig
from glmtune.models.common.family import ModelDims, ModelFamily
from glmtune.models.common.hf_config import read_hf_config
from glmtune.models.glm5.family import GLM5_FAMILY

FAMILIES: tuple[ModelFamily, ...] = (GLM5_FAMILY,)

# preset name -> its family: the presets are the families' own tables, listed once here.
PRESETS: dict[str, ModelFamily] = {name: family for family in FAMILIES for name in family.presets}
assert len(PRESETS) == sum(len(family.presets) for family in FAMILIES), "two families name the same preset"

# An HF directory (or its config.json) -> its architecture: a family's `read_args` (config.json
# alone) unless the caller passes a reader that checks the weights too (the registry's).
HfReader = Callable[[str], Any]


def is_preset(name_or_path: str | Path) -> bool:
    return str(name_or_path) in PRESETS


def family_for(name_or_path: str | Path) -> ModelFamily:
    """The family of a preset, or of an HF directory (or config.json) by its `model_type`."""
    if is_preset(name_or_path):
        return PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"{name_or_path}: neither a model preset ({', '.join(PRESETS)}) nor an existing path")
    config = path / "config.json" if path.is_dir() else path
    model_type = read_hf_config(config).get("model_type", FAMILIES[0].hf_model_type)
    for family in FAMILIES:
        if family.hf_model_type == model_type:
            return family
    known = ", ".join(repr(f.hf_model_type) for f in FAMILIES)
    raise ValueError(f"{config}: model_type is {model_type!r}, expected {known} (the families glmtune trains)")


def readable_name(model: ModelConfig) -> tuple[str, str]:
    """(a preset or a readable HF directory, where its numbers come from) for `model`: a path that
    does not exist yet (a recipe's `/path/to/GLM-5` placeholder) falls back to `model.validate_as`."""
    name = model.name_or_path
    if is_preset(name):
        return name, f"preset {name}"
    if (Path(name) / "config.json").is_file():
        return name, f"{name}/config.json"
    if model.validate_as is not None:
        if not is_preset(model.validate_as):
            raise ValueError(f"model.validate_as: {model.validate_as!r} is not a preset; choose from "
                             f"{', '.join(PRESETS)}")
        return model.validate_as, f"preset {model.validate_as} (model.validate_as; {name} not found)"
    raise ValueError(
        f"model.name_or_path: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
        "with config.json; set model.validate_as to a preset to validate without the weights")


def model_family(model: ModelConfig) -> ModelFamily:
    """The family of the model a recipe's `model` section names (a placeholder path: of its
    `model.validate_as`)."""
    return family_for(readable_name(model)[0])


def model_args(model: ModelConfig, read_hf: HfReader | None = None) -> Any:
    """The architecture `model` names: a preset after `model.overrides`, an HF directory's
    config.json (through `read_hf`; by default the family's, which reads config.json alone), or
    `model.validate_as` for a placeholder path."""
    name, _ = readable_name(model)
    family = family_for(name)
    if is_preset(name):
        return family.with_overrides(family.preset_args(name), model.overrides)
    if model.overrides:
        raise ValueError("model.overrides apply to presets only; edit the checkpoint's config.json instead")
    return (read_hf or family.read_args)(name)


def model_dims(model: ModelConfig, read_hf: HfReader | None = None) -> ModelDims:
    """Experts and layers of the model `model` names (after `model.overrides`), for the layout
    check, with what no layout can run of `model` (`refusals`, for `validate_config`); an HF
    directory read as `model_args` reads it."""
    name, source = readable_name(model)
    family = family_for(name)
    args = family.preset_args(name) if is_preset(name) else (read_hf or family.read_args)(name)
    # Overrides such as fewer layers for a smoke test change what the parallel plan must fit.
    return dataclasses.replace(family.dims(args, source, model.overrides), refusals=tuple(model_refusals(model)))


def model_refusals(model: ModelConfig) -> list[str]:
    """What the recipe's `model` section asks that its model cannot be: an FP8 base on a preset
    (an FP8 base is read from a checkpoint, and the adapter must name the one it trained on)."""
    if model.fp8_base != "none" and is_preset(model.name_or_path):
        return [f"model.fp8_base: {model.fp8_base} needs an HF checkpoint directory in model.name_or_path, not "
                f"the preset {model.name_or_path!r} (the adapter must name the FP8 base it trained on)"]
    return []
