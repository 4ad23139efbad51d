"""A full fine-tuning checkpoint (DCP) as an HF directory, a bounded group of tensors at a time.

`stream_export` writes, bit for bit, what `save_pretrained(model, OUT, dtype=...)` writes for
the run's model holding the checkpoint's weights (the export at the end of `glmtune train`):
the same shard files (`plan_shards` of the model on the meta device), the same index,
config.json and tokenizer files (`write_metadata`), each tensor cast from the checkpoint's
dtype (fp32 master weights) to the dtype it is written in as `host_copy` casts it. It never
builds the weights: it walks the shard plan, reads from the checkpoint the *units* the next
HF tensors come from (a whole tensor, or one expert's slab of a stacked expert tensor: its
gate, up and down rows), a group of consecutive units of at most `max_shard_size` bytes as
stored (one unit when larger) per `dcp.load`, cuts each unit into its HF tensors, writes each
shard file as soon as its last tensor is ready and frees it.

Peak host memory: one output shard (twice while safetensors serializes it), one group of
units as stored, and the stored chunks DCP reads for it (`torch.load` of one rank's piece of a
tensor, whole; the whole tensor for a one-process checkpoint, about 1/N of it for one written
by N ranks; DCP holds the last one read while it reads the next), whatever the model's size.

Knows no family: the spec passes its `HfFormat` and the model's args (models/common/hf_format.py:
the state-dict adapter's HF keys and the views they are of, the model on meta whose dtypes the
tensors are written in, config.json), as to `save_pretrained`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torch.distributed.checkpoint.api import CheckpointException

from glmtune.checkpoint.dcp_storage import JsonMetadataReader, WeightsOnlyLoadPlanner, failure_of
from glmtune.checkpoint.fp8_layout import is_fp8
from glmtune.checkpoint.hf_io import (
    host_copy,
    meta_state,
    plan_shards,
    write_metadata,
    write_planned_shards,
    written_dtypes,
)
from glmtune.io.outputs import output_dir
from glmtune.io.sizes import parse_size
from glmtune.models.common.hf_format import HfFormat

MODEL_PREFIX = "model."  # CheckpointManager saves {"model": ..., "optim": ...}; DCP flattens the keys
Unit = tuple[str, int | None]  # (model state key, expert index of a stacked expert tensor, or None: all of it)


@dataclass(frozen=True)
class _Part:
    """One HF tensor: a view (shape, stride, offset) of `unit`'s slab as read from the checkpoint."""

    unit: Unit
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def stream_export(model: nn.Module, checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype, *,
                  fmt: HfFormat, args: Any, source_dir: str | Path | None, max_shard_size: int | str = "5GB",
                  overwrite: bool = False, sources=(), what: str = "OUT",
                  write_config: Callable[[Path], None] | None = None) -> Path:
    """Write the weights of DCP checkpoint `checkpoint_dir` as the HF directory `out_dir`, as
    `save_pretrained(model, out_dir, dtype=dtype, source_dir=source_dir)` writes them for `model`
    holding those weights, through `output_dir` (never over an input: `source_dir`, `sources`).

    Args:
        model: the run's model on the meta device (its state-dict keys, shapes and args).
        dtype: the dtype the run computed in (the export's; GLM-5's routers stay fp32).
        fmt, args: the family's `HfFormat` and the model's args: the state-dict adapter (`to_hf`),
            and the dtype `save_pretrained` writes each tensor in (`written_dtypes`, from the model
            built in `dtype` on meta; a tied head is not written).
        write_config: the family's own writer of config.json (and its companions) into the directory
            being built, as its `save_pretrained` writes them (the hf family's: transformers' own);
            None: `fmt.hf_config`'s config.json. Tokenizer files are copied after it.
    """
    limit = parse_size(max_shard_size)
    adapter, written = fmt.adapter(args), written_dtypes(fmt, args, dtype)
    if source_dir is not None:
        sources = (*sources, ("the tokenizer", source_dir))
    state = model.state_dict()
    assert not any(is_fp8(tensor) for tensor in state.values()), "a full fine-tuning run has no FP8 base"
    reader = _LayoutReader(checkpoint_dir)
    layout = reader.read_metadata()
    _check_layout(Path(checkpoint_dir), state, layout)
    shards = plan_shards(_held(adapter, meta_state(state), written), written, limit)
    parts = _hf_parts(adapter, state, written)
    units = _CheckpointUnits(reader, state, layout, parts, [hf_key for shard in shards for hf_key, _ in shard], limit)
    with output_dir(out_dir, overwrite=overwrite, sources=sources, what=what) as tmp:
        weight_map, total = _write_shards(tmp, shards, units)
        if write_config is not None:
            write_config(tmp)
        config = fmt.hf_config(args) if write_config is None else None
        write_metadata(config, tmp, shards, weight_map, total, dtype, source_dir, fp8=False)
    return Path(out_dir)


class _LayoutReader(JsonMetadataReader):
    """The checkpoint's reader, its layout (`dcp_metadata.json`) parsed once for every `dcp.load`."""

    _layout: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._layout is None:
            self._layout = super().read_metadata(*args, **kwargs)
        return self._layout


def _check_layout(checkpoint_dir: Path, state: dict[str, torch.Tensor], layout: Metadata) -> None:
    """Every tensor of the run's model is in the checkpoint, in its shape; else a ValueError
    naming the first that is not (the checkpoint is not this run's model's)."""
    stored = layout.state_dict_metadata
    for key, tensor in state.items():
        entry = stored.get(MODEL_PREFIX + key)
        if entry is None or not hasattr(entry, "size"):
            raise ValueError(f"checkpoint {checkpoint_dir} holds no tensor {key}: not a checkpoint of this run's "
                             "model (or of a LoRA run, whose checkpoints hold the adapters only)")
        if tuple(entry.size) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {checkpoint_dir}: {key} has shape {tuple(entry.size)}, the run's model "
                             f"{tuple(tensor.shape)}: not a checkpoint of this run's model")


def _held(adapter: Any, state: dict[str, torch.Tensor], written: dict[str, torch.dtype]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, view of `state`) of every tensor the export writes (those of `written`), in state order."""
    for key, tensor in state.items():
        yield from ((hf_key, view) for hf_key, view in adapter.to_hf(key, tensor) if hf_key in written)


def _hf_parts(adapter: Any, state: dict[str, torch.Tensor], written: dict[str, torch.dtype]) -> dict[str, _Part]:
    """HF key -> where its tensor lies in the model's state, read off the adapter's own views of
    the meta state: a whole tensor, or within one expert of a stacked expert tensor."""
    parts = {}
    for key, tensor in state.items():
        for hf_key, view in _held(adapter, {key: tensor}, written):
            expert = None if view.dim() == tensor.dim() else view.storage_offset() // tensor.stride(0)
            offset = view.storage_offset() - (expert or 0) * tensor.stride(0)
            parts[hf_key] = _Part((key, expert), tuple(view.shape), tuple(view.stride()), offset)
    return parts


class _BoxLoadPlanner(WeightsOnlyLoadPlanner):
    """Reads, for each key of its state dict, the box (offsets, sizes) of the stored tensor that
    key's destination holds: a whole tensor, or a range of experts of a stacked one."""

    def __init__(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn in self.state_dict:
            offsets, sizes = self.boxes[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the box's own tensor; read items' offsets are relative to it


class _CheckpointUnits:
    """Serves each unit's HF tensors (as written), loading groups of consecutive units in plan
    order, `budget` bytes as stored at a time (one unit when larger)."""

    def __init__(self, reader: _LayoutReader, state: dict[str, torch.Tensor], layout: Metadata,
                 parts: dict[str, _Part], order: list[str], budget: int) -> None:
        self.reader, self.state, self.parts = reader, state, parts
        self.stored = {key: layout.state_dict_metadata[MODEL_PREFIX + key].properties.dtype for key in state}
        self.unit_keys: dict[Unit, list[str]] = {}
        for hf_key in order:
            self.unit_keys.setdefault(parts[hf_key].unit, []).append(hf_key)
        self.groups = _groups(list(self.unit_keys), self._unit_bytes, budget)
        self.loaded: dict[Unit, torch.Tensor] = {}

    def _unit_bytes(self, unit: Unit) -> int:
        key, expert = unit
        shape = self.state[key].shape if expert is None else self.state[key].shape[1:]
        return torch.Size(shape).numel() * self.stored[key].itemsize

    def tensors(self, unit: Unit, casts: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """HF key -> host tensor in its written dtype, of every part of `unit` (read once, then freed)."""
        while unit not in self.loaded:
            self.loaded = self._load(next(self.groups))
        slab = self.loaded.pop(unit)
        out = {}
        for hf_key in self.unit_keys[unit]:
            part = self.parts[hf_key]
            out[hf_key] = host_copy(slab.as_strided(part.shape, part.stride, slab.storage_offset() + part.offset),
                                    casts[hf_key])
        return out

    def _load(self, group: list[Unit]) -> dict[Unit, torch.Tensor]:
        """One `dcp.load` of a group's units: each whole tensor, each run of consecutive experts
        of one stacked tensor as one box."""
        boxes, destinations, runs = {}, {}, {}
        for key, expert in group:
            runs.setdefault(key, []).append(expert)
        for key, experts in runs.items():
            shape = tuple(self.state[key].shape)
            first = 0 if experts[0] is None else experts[0]
            sizes = shape if experts[0] is None else (len(experts), *shape[1:])
            assert experts[0] is None or experts == list(range(first, first + len(experts))), (key, experts)
            boxes[MODEL_PREFIX + key] = ((first,) + (0,) * (len(shape) - 1), sizes)
            destinations[MODEL_PREFIX + key] = torch.empty(sizes, dtype=self.stored[key])
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.load(destinations, storage_reader=self.reader, planner=_BoxLoadPlanner(boxes), no_dist=True)
        except (Exception, CheckpointException) as exc:  # a damaged or planted item, named by the reader
            raise ValueError(f"checkpoint {self.reader.path} cannot be read: {failure_of(exc)[:400]}") from exc
        loaded = {}
        for (key, expert) in group:
            tensor = destinations[MODEL_PREFIX + key]
            loaded[(key, expert)] = tensor if expert is None else tensor[expert - runs[key][0]]
        return loaded


def _groups(units: list[Unit], nbytes, budget: int) -> Iterator[list[Unit]]:
    """Consecutive units, at most `budget` bytes a group (a larger unit alone); experts of a
    stacked tensor never share a group with another tensor. DCP keeps the stored chunk it read
    last while it reads the next, and a stacked tensor's chunk is larger than a group: two of
    them in one group would be held together."""
    group, size = [], 0
    for unit in units:
        other_tensor = group and group[-1][0] != unit[0] and (group[-1][1] is not None or unit[1] is not None)
        if group and (size + nbytes(unit) > budget or other_tensor):
            yield group
            group, size = [], 0
        group.append(unit)
        size += nbytes(unit)
    if group:
        yield group


def _write_shards(tmp: Path, shards: list[list[tuple[str, torch.dtype]]], units: _CheckpointUnits
                  ) -> tuple[dict[str, str], int]:
    """Each planned shard file, written as soon as its tensors are read; (weight map, bytes)."""
    casts = {hf_key: cast for shard in shards for hf_key, cast in shard}
    size = sum(torch.Size(units.parts[key].shape).numel() * cast.itemsize for key, cast in casts.items())
    return write_planned_shards(tmp, shards, lambda key: units.tensors(units.parts[key].unit, casts), size,
                                "exporting")
