"""config.json and generation_config.json of an `hf` family model, as transformers' `save_pretrained` writes them.

Two writers put an `hf` model in a directory: the spec's `save_pretrained` (transformers' own, for a
built model) and the streamed export of a training checkpoint (glmtune/checkpoint/export_stream.py,
for a model on the meta device), which writes the weights itself and the configurations here. Both
give the same files:

  config.json             transformers' `config.save_pretrained`, then the class transformers
                          would name (not FSDP2's `FSDP<class>` subclass) as `architectures[0]`,
                          `dtype` the dtype the tensors are written in, keys sorted
  generation_config.json  transformers' `generation_config.save_pretrained` for a model that
                          generates: the base directory's own file when it has one (what
                          `from_pretrained` keeps), else what transformers derives from the config

Transformers' progress bars stay off around its own save calls (quiet.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import GenerationConfig

from glmtune.models.hf.quiet import no_progress_bars

GENERATION_CONFIG = "generation_config.json"


def unwrapped_class(model: nn.Module) -> type:
    """transformers' class of `model`, under FSDP2's `FSDP<class>` subclass when it is sharded."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def settle_config(directory: Path, model: nn.Module, dtype: torch.dtype | None) -> None:
    """Rewrite `directory`'s config.json (written by transformers) with `model`'s own class and `dtype`
    (None: as written), keys sorted."""
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = [unwrapped_class(model).__name__]
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def base_generation_config(model: nn.Module, base_dir: str | Path | None) -> GenerationConfig | None:
    """The generation config `from_pretrained(base_dir)` gives `model`: the base's file when it has
    one, else transformers' own from the model's config (None: the model does not generate)."""
    if not model.can_generate():
        return None
    if base_dir is not None and (Path(base_dir) / GENERATION_CONFIG).is_file():
        return GenerationConfig.from_pretrained(base_dir, local_files_only=True)
    return model.generation_config


def write_configs(directory: Path, model: nn.Module, dtype: torch.dtype, base_dir: str | Path | None) -> None:
    """config.json and generation_config.json of `model` (on any device, meta included) holding tensors
    in `dtype`, into `directory`, as the spec's `save_pretrained` writes them (module docstring)."""
    generation = base_generation_config(model, base_dir)
    with no_progress_bars():  # glmtune reports the export itself (quiet.py)
        model.config.save_pretrained(directory)
        if generation is not None:
            generation.save_pretrained(directory)
    settle_config(directory, model, dtype)
