"""The model a recipe names, built by its family's front door (`glmtune/models/registry.py`).

`build_model_from_config` is the one way a command turns the recipe's `model` section into a
model: its family's spec builds a preset (initialized from the run's seed) or loads an HF
directory, in the run's parameter dtype (fp32 under fp32 master weights: `precision.py`);
on the meta device an HF directory is read for its architecture only (an FP8 base converted),
for the sharded load after parallelization.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glmtune.config import JobConfig
from glmtune.models.registry import spec_for
from glmtune.train.precision import resolve_precision


def build_model_from_config(cfg: JobConfig, device: torch.device | str = "cpu",
                            seed: int | None = None) -> tuple[torch.nn.Module, Path | None]:
    """The model `cfg.model` names and the HF directory it came from (None for a preset), its
    parameters in the run's parameter dtype.

    With `device="meta"` and an HF directory nothing is read but config.json: the model has the
    checkpoint's architecture and no storage, for `load_sharded` after `parallelize`.
    """
    return spec_for(cfg.model.name_or_path, cfg.model.family).weights.build_from_config(
        cfg.model, resolve_precision(cfg).param_dtype, device, cfg.train.seed if seed is None else seed)


def tokenizer_dir_for(cfg: JobConfig, model_dir: Path | None) -> Path | None:
    """The tokenizer: data.tokenizer, else the model directory's, else the bundled tiny one."""
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    return model_dir
