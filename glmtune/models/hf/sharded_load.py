"""`load_sharded`: an `hf` family model built on meta and parallelized (FSDP2), filled from its HF
directory on every rank.

Each rank reads the directory's tensors (weights.py `weight_files`, safetensors) and keeps its own
shard of each: torch's `set_model_state_dict` with a full state dict slices every DTensor parameter
locally (no collective). Every rank reads the whole checkpoint in turn, one file at a time, so the
peak is one file's tensors besides the rank's shards: a first version for the sizes the hf family
serves (a reader of only the rank's byte ranges is GLM-5's, checkpoint/sharded_load.py).

transformers keeps rotary inverse frequencies as non-persistent buffers computed at construction;
on meta they hold nothing, so they are computed again through transformers' own initializer.
A MoE layer's stacked experts are stored per expert (state_dict_adapter.py names them): each stacked
parameter is assembled whole on the host from its per-expert tensors, then handed over like any
other (the peak grows by one stacked parameter: one layer's experts of one projection).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from glmtune.models.common.hf_format import Target
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.state_dict_adapter import HfStateDictAdapter
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


def reset_rotary_buffers(model: nn.Module) -> None:
    """The rotary inverse frequencies of a model materialized by `to_empty`, by transformers' own
    initializer (the name rule its `_init_weights` applies to rotary embeddings)."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            model._init_weights(module)


def load_sharded(model: nn.Module, hf_dir: str | Path, args: HfArgs, device: Any,
                 not_in_checkpoint: set[str] = frozenset()) -> HfLoadStats:
    """Fill the meta-built, parallelized `model` (`args`: its directory's, weights checked) from
    `hf_dir` (module docstring); `not_in_checkpoint`: keys left for the caller to initialise.
    Returns what the rank read."""
    start = time.perf_counter()
    model.to_empty(device=device)
    reset_rotary_buffers(model)
    adapter = HfStateDictAdapter(args)
    stacks = _StackedExperts(model.state_dict(), adapter, not_in_checkpoint)
    wanted = set(stacks.shapes)
    files = weight_files(Path(hf_dir))
    loaded: set[str] = set()
    bytes_read = 0
    for file in files:
        tensors = {}
        with safe_open(file, framework="pt", device="cpu") as reader:
            for hf_key in reader.keys():
                target = adapter.from_hf_key(hf_key)
                if target is None or target.key not in wanted:
                    continue
                tensor = reader.get_tensor(hf_key)
                bytes_read += tensor.numel() * tensor.element_size()
                if target.expert is None:
                    tensors[target.key] = tensor
                else:  # one expert's slab of a stacked parameter, whole once its last part is read
                    tensors.update(stacks.fill(target, hf_key, tensor, file))
        if args.tie_word_embeddings and "model.embed_tokens.weight" in tensors and "lm_head.weight" in wanted:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
        loaded |= set(tensors)
    missing = sorted(wanted - loaded)
    if missing:
        raise ValueError(f"{hf_dir}: no tensor {stacks.first_missing(missing[0])} in its safetensors files "
                         f"({len(missing)} model tensors incomplete)")
    return HfLoadStats(len(loaded), len(files), bytes_read, time.perf_counter() - start)


class _StackedExperts:
    """The stacked expert parameters being assembled from their per-expert tensors: each a whole
    (unsharded) host tensor until its last part is read, then handed over and freed."""

    def __init__(self, state: dict[str, torch.Tensor], adapter: HfStateDictAdapter, skip: set[str]) -> None:
        self.shapes = {key: (tuple(t.shape), t.dtype) for key, t in state.items() if key not in skip}
        self.parts = {}  # key -> the HF keys of its parts not read yet
        for key, (shape, _) in self.shapes.items():
            hf_keys = [hf_key for hf_key, _ in adapter.to_hf(key, torch.empty(shape, device="meta"))]
            if hf_keys != [key]:
                self.parts[key] = set(hf_keys)
        self.buffers: dict[str, torch.Tensor] = {}

    def fill(self, target: Target, hf_key: str, tensor: torch.Tensor, file: Path) -> dict[str, torch.Tensor]:
        """Copy HF tensor `hf_key` (of `file`) in; {key: the whole tensor} when it was the last, else {}."""
        shape, dtype = self.shapes[target.key]
        buffer = self.buffers.setdefault(target.key, torch.empty(shape, dtype=dtype))
        dest = buffer[target.expert]
        if target.rows is not None:
            dest = dest[target.rows[0] : target.rows[1]]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"{file}: {hf_key} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        names = self.parts[target.key]
        names.discard(hf_key)
        return {target.key: self.buffers.pop(target.key)} if not names else {}

    def first_missing(self, key: str) -> str:
        """The first HF tensor of model tensor `key` not read (`key` itself when it is not stacked)."""
        return min(self.parts.get(key) or {key})
