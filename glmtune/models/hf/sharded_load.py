"""`load_sharded`: an `hf` family model built on meta and parallelized (FSDP2), filled from its HF
directory on every rank.

Each rank reads the directory's tensors (weights.py `weight_files`, safetensors) and keeps its own
shard of each: torch's `set_model_state_dict` with a full state dict slices every DTensor parameter
locally (no collective). Every rank reads the whole checkpoint in turn, one file at a time, so the
peak is one file's tensors besides the rank's shards: a first version for the sizes the hf family
serves (a reader of only the rank's byte ranges is GLM-5's, checkpoint/sharded_load.py).

transformers keeps rotary inverse frequencies as non-persistent buffers computed at construction;
on meta they hold nothing, so they are computed again through transformers' own initializer.
A MoE model is refused: transformers fuses its per-expert tensors as it loads (state_dict_adapter.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.weights import weight_files


@dataclass(frozen=True)
class HfLoadStats:
    """What one rank read (the trainer prints `describe()`)."""

    tensors: int
    files: int
    bytes_read: int
    seconds: float

    def describe(self) -> str:
        return (f"read {self.bytes_read / 2**30:.3f} GiB ({self.tensors} tensors, {self.files} files, each rank the "
                f"whole checkpoint) in {self.seconds:.1f} s")


def _rotary_buffers(model: nn.Module) -> None:
    # the name rule transformers' `_init_weights` itself applies to rotary embeddings
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            model._init_weights(module)


def load_sharded(model: nn.Module, hf_dir: str | Path, args: HfArgs, device: Any,
                 not_in_checkpoint: set[str] = frozenset()) -> HfLoadStats:
    """Fill the meta-built, parallelized `model` (`args`: its directory's, weights checked) from
    `hf_dir` (module docstring); `not_in_checkpoint`: keys left for the caller to initialise.
    Returns what the rank read."""
    if args.num_experts:
        raise ValueError(f"{args.architecture}: the hf family does not do a sharded load of a MoE model yet "
                         "(transformers fuses its experts as it loads); run it in one process")
    start = time.perf_counter()
    model.to_empty(device=device)
    _rotary_buffers(model)
    wanted = {key for key in model.state_dict() if key not in not_in_checkpoint}
    files = weight_files(Path(hf_dir))
    loaded: set[str] = set()
    bytes_read = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as reader:
            tensors = {key: reader.get_tensor(key) for key in reader.keys() if key in wanted}
        if args.tie_word_embeddings and "model.embed_tokens.weight" in tensors and "lm_head.weight" in wanted:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
        loaded |= set(tensors)
        bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
    missing = sorted(wanted - loaded)
    if missing:
        raise ValueError(f"{hf_dir}: no tensor {missing[0]} in its safetensors files ({len(missing)} missing)")
    return HfLoadStats(len(loaded), len(files), bytes_read, time.perf_counter() - start)
