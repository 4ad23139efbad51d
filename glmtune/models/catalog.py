"""The model families glmtune knows, and what a recipe's `model` section names: without torch.

`FAMILIES` lists each family's torch-free answers (`ModelFamily`, models/common/family.py);
`family_for(name_or_path, family)` is the family of a preset name or an HF directory: a preset's
own; a directory whose config.json `model_type` is a native family's (GLM-5's `glm_moe_dsa`) goes
to that family, any other to `hf` (any causal LM transformers implements: models/hf/); a
recipe's `model.family` forces one (`hf` on a native model_type: transformers' own class as a
baseline; a preset never goes to `hf`). `model_args` and `model_dims` resolve a recipe's model section
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
from glmtune.models.hf.family import ANY_MODEL_TYPE, HF_FAMILY

# The native families first; the last takes any model_type none of them claims.
FAMILIES: tuple[ModelFamily, ...] = (GLM5_FAMILY, HF_FAMILY)
NATIVE: dict[str, ModelFamily] = {family.hf_model_type: family for family in FAMILIES[:-1]}
FALLBACK = FAMILIES[-1]
assert FALLBACK.hf_model_type == ANY_MODEL_TYPE and ANY_MODEL_TYPE not in NATIVE, "one family takes the rest"
BY_NAME: dict[str, ModelFamily] = {family.name: family for family in FAMILIES}
AUTO = "auto"  # model.family: chosen by the preset or config.json's model_type

# preset name -> its family: the presets are the families' own tables, listed once here.
PRESETS: dict[str, ModelFamily] = {name: family for family in FAMILIES for name in family.presets}
assert len(PRESETS) == sum(len(family.presets) for family in FAMILIES), "two families name the same preset"

# (family, an HF directory or its config.json) -> its architecture: the family's `read_args`
# (config.json alone) unless the caller passes a reader that checks the weights too (the registry's).
HfReader = Callable[[ModelFamily, str], Any]


def is_preset(name_or_path: str | Path) -> bool:
    return str(name_or_path) in PRESETS


def forced_family(family: str) -> ModelFamily | None:
    """The family `model.family` names (None for auto); an unknown name is refused naming the key."""
    if family == AUTO:
        return None
    if family not in BY_NAME:
        raise ValueError(f"model.family: {family!r} is not a model family; choose {AUTO}, {', '.join(BY_NAME)}")
    return BY_NAME[family]


def family_for(name_or_path: str | Path, family: str = AUTO) -> ModelFamily:
    """The family of a preset, or of an HF directory (or config.json) by its `model_type`
    (module docstring); `family` (a recipe's `model.family`) forces one where it can."""
    forced = forced_family(family)
    if is_preset(name_or_path):
        own = PRESETS[str(name_or_path)]
        if forced not in (None, own):
            raise ValueError(f"model.family: {family} does not take the preset {str(name_or_path)!r} (a preset of "
                             f"{own.name}); set model.name_or_path to an HF directory")
        return own
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"{name_or_path}: neither a model preset ({', '.join(PRESETS)}) nor an existing path")
    config = path / "config.json" if path.is_dir() else path
    model_type = read_hf_config(config).get("model_type", FAMILIES[0].hf_model_type)
    native = NATIVE.get(model_type)
    if forced is None or forced in (native, FALLBACK):
        return forced or native or FALLBACK
    raise ValueError(f"model.family: {family} trains model_type {forced.hf_model_type!r}, but {config} has "
                     f"model_type {model_type!r}; set model.family: {AUTO}")


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
    return family_for(readable_name(model)[0], model.family)


def model_args(model: ModelConfig, read_hf: HfReader | None = None) -> Any:
    """The architecture `model` names: a preset after `model.overrides`, an HF directory's
    config.json (through `read_hf`; by default the family's, which reads config.json alone), or
    `model.validate_as` for a placeholder path."""
    name, _ = readable_name(model)
    family = family_for(name, model.family)
    if is_preset(name):
        return family.with_overrides(family.preset_args(name), model.overrides)
    if model.overrides:
        raise ValueError("model.overrides apply to presets only; edit the checkpoint's config.json instead")
    return _read_dir(family, name, read_hf)


def _read_dir(family: ModelFamily, path: str, read_hf: HfReader | None) -> Any:
    return read_hf(family, path) if read_hf else family.read_args(path)


def model_dims(model: ModelConfig, read_hf: HfReader | None = None) -> ModelDims:
    """Experts and layers of the model `model` names (after `model.overrides`), for the layout
    check, with what no layout can run of `model` (`refusals`, for `validate_config`: sentences, and
    the family's limits on the recipe's settings); an HF directory read as `model_args` reads it."""
    name, source = readable_name(model)
    family = family_for(name, model.family)
    args = family.preset_args(name) if is_preset(name) else _read_dir(family, name, read_hf)
    # Overrides such as fewer layers for a smoke test change what the parallel plan must fit.
    refusals = (*model_refusals(model), *family.limits)
    return dataclasses.replace(family.dims(args, source, model.overrides), refusals=refusals)


def model_refusals(model: ModelConfig) -> list[str]:
    """What the recipe's `model` section asks that its model cannot be: an FP8 base on a preset
    (an FP8 base is read from a checkpoint, and the adapter must name the one it trained on)."""
    if model.fp8_base != "none" and is_preset(model.name_or_path):
        return [f"model.fp8_base: {model.fp8_base} needs an HF checkpoint directory in model.name_or_path, not "
                f"the preset {model.name_or_path!r} (the adapter must name the FP8 base it trained on)"]
    return []
