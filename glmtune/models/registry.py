"""The runtime side of the model families: each family's `ModelSpec`, and a recipe's model with
its weights checked.

The catalog (catalog.py, torch-free) knows the families, the presets and how a recipe's
`model` section names a model; this module adds what needs a family's spec, and with it torch:
`spec_for(name_or_path)`, `model_spec(model)`, `hf_dir_identity(hf_dir)` (a base's fingerprint),
`decoding_of(built_model)` (the cached-decoding
hooks of a built model's family, for `glmtune.generation`), and `model_args` / `model_dims` that
read an HF directory through the spec's `args_from_hf`, which checks the directory's weights against its
config.json (train, eval, inspect, plan, preflight; `config validate` reads config.json alone
through the catalog). The families: GLM-5 (native) and `hf` (any causal LM transformers implements,
which imports transformers). A second family is one more entry in `SPECS` (and the catalog's `FAMILIES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.checkpoint.fingerprint import base_identity_from_dir
from glmtune.config.schema import ModelConfig
from glmtune.models import catalog
from glmtune.models.catalog import PRESETS, is_preset
from glmtune.models.common.decoding import CachedDecoding
from glmtune.models.common.family import ModelDims, ModelFamily
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.glm5.spec import GLM5
from glmtune.models.hf.spec import HF

# PRESETS and is_preset are the catalog's, re-exported for the commands that ask the registry.
__all__ = ["PRESETS", "SPECS", "decoding_of", "hf_dir_identity", "is_preset", "model_args", "model_dims", "model_spec",
           "resolve_args", "spec_for"]

# family name -> its spec: every family of the catalog has one.
SPECS: dict[str, ModelSpec] = {spec.family.name: spec for spec in (GLM5, HF)}
assert [family.name for family in catalog.FAMILIES] == list(SPECS), "a family of the catalog has no spec"


def spec_for(name_or_path: str | Path, family: str = catalog.AUTO) -> ModelSpec:
    """The family's spec of a preset, or of an HF directory (or config.json) by its `model_type`
    (`family`: a recipe's `model.family`, which forces one; `catalog.family_for`)."""
    return SPECS[catalog.family_for(name_or_path, family).name]


def hf_dir_identity(hf_dir: str | Path, num_threads: int | None = None) -> dict[str, Any]:
    """The content identity of an HF directory (`checkpoint.fingerprint`), its config read by the
    family its config.json's `model_type` names."""
    return base_identity_from_dir(hf_dir, spec_for(hf_dir).family.read_args, num_threads)


def _args_from_hf(family: ModelFamily, path: str) -> Any:
    """An HF directory's architecture, checked against its weights (the family's spec's `args_from_hf`)."""
    return SPECS[family.name].architecture.args_from_hf(path)


def resolve_args(name_or_path: str | Path) -> Any:
    """The architecture of a preset or an HF directory (its family's args)."""
    spec = spec_for(name_or_path)
    if is_preset(name_or_path):
        return spec.family.preset_args(str(name_or_path))
    return spec.architecture.args_from_hf(name_or_path)


def model_spec(model: ModelConfig) -> ModelSpec:
    """The family's spec of the model a recipe's `model` section names (a placeholder path: of its
    `model.validate_as`)."""
    return SPECS[catalog.model_family(model).name]


def model_args(model: ModelConfig) -> Any:
    """The architecture `model` names, without building it: a preset after `model.overrides`, an
    HF directory's config.json checked against its weights, or `model.validate_as` for a placeholder."""
    return catalog.model_args(model, read_hf=_args_from_hf)


def model_dims(model: ModelConfig) -> ModelDims:
    """Experts and layers of the model `model` names (`catalog.model_dims`), an HF directory's
    checked against its weights."""
    return catalog.model_dims(model, read_hf=_args_from_hf)


def decoding_of(model: Any) -> CachedDecoding | None:
    """The cached-decoding hooks of the family a built `model` belongs to (None: no family's)."""
    return next((spec.decoding for spec in SPECS.values() if spec.decoding is not None and spec.decoding.owns(model)),
                None)
