"""`glmtune merge` shard by shard: the merged checkpoint without the model in memory.

`stream_merge` writes, bit for bit, the checkpoint `save_pretrained` writes for the base
loaded whole (`load_pretrained`), merged (`merge_adapter_dir`) and, with `fp8`, re-quantized
(`convert_to_fp8_base`): the same shard files (`shard_plan` of the model built on the meta
device), the same index, config.json and tokenizer files (`write_metadata`). It never builds
the weights: for each output shard it reads the base tensors that shard needs, one *unit* at a
time (a whole tensor, or one expert's slab of a stacked expert tensor: gate and up rows
together, as the stacked weight is quantized), copies them into the base dtype as the loader
does (FP8 blocks dequantized in fp32 first), adds the adapter deltas of that unit in fp32 in
the adapter's order (a fused PEFT pair's delta one expert at a time: each entry of a `bmm`
is its own matmul), re-quantizes it per 128 x 128 block, writes the shard and frees it. The
parts of a unit that belong to a later shard (its up rows past a shard boundary, its FP8
scales) wait in memory until their shard is written.

Peak host memory: one output shard (twice while safetensors serializes it), the base file
pages of the input shard being read (mapped, released when the next file is opened), the
adapter in fp32, and one unit with its fp32 temporaries, whatever the model's size.

Knows no family: BASE_DIR's spec (the registry's `spec_for`) gives its `hf_format` (config.json
read and written, the HF names, the model on meta) and, for `--fp8`, its `convert_to_fp8_base`.
The hf family's checkpoints are written by the same shard writer under the names transformers
stores them by (a MoE layer's experts per expert: its state-dict adapter's); GLM-5's equal its
`save_pretrained`, bit for bit.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from glmtune.checkpoint.hf_io import (
    check_complete,
    check_shard_sizes,
    checkpoint_files,
    fp8_scale_key,
    host_copy,
    open_shard,
    read_plan,
    read_tensor,
    shard_plan,
    tensor_destination,
    write_metadata,
    write_planned_shards,
)
from glmtune.checkpoint.fp8_layout import SCALE_SUFFIX, check_fp8_scale, dequantize_fp8_block, is_fp8
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.io.outputs import output_dir
from glmtune.io.sizes import parse_size
from glmtune.kernels import fp8_blocks
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import spec_for

_M_MMAP_THRESHOLD = -3  # glibc mallopt
_MMAP_THRESHOLD = 4 << 20
Unit = tuple[str, int | None]  # (model weight key, expert index or None for the whole tensor)
_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class _Part:
    """One tensor of the merged checkpoint: `key`'s rows `rows` (None: all) of `unit`'s result."""

    key: str
    unit: Unit
    rows: tuple[int, int] | None


def stream_merge(base_dir: Path, out_dir: str | Path, dtype: torch.dtype,
                 deltas_for: Callable[[nn.Module], list], max_shard_size: int | str, *,
                 fp8: bool, overwrite: bool, sources) -> list[tuple[float, float]]:
    """Write BASE_DIR merged with the deltas `deltas_for(model)` gives (`merge.Delta`s, resolved on
    the model built in `dtype` on the meta device) to `out_dir`, through `output_dir`.

    BASE_DIR's family (its config.json's `model_type`, the registry's `spec_for`) says how its
    checkpoints are stored (`ModelSpec.hf_format`: config.json, HF names, the model on meta) and,
    with `fp8`, which weights its FP8 base holds in e4m3 (`convert_to_fp8_base` on the meta model).

    Returns, with `fp8`, each re-quantized weight's (squared error, squared norm), as
    `convert_to_fp8_base(errors=)` gives them for the merged model; otherwise [].
    """
    _return_freed_memory()
    spec = spec_for(base_dir)
    fmt, args, files, model, plan = _base(spec, base_dir, dtype)
    state, adapter = model.state_dict(keep_vars=True), fmt.adapter(args)
    alias = _aliases(state)
    deltas: dict[str, list] = defaultdict(list)
    for delta in deltas_for(model):
        deltas[alias[delta.key]].append(delta)
    inputs: dict[Unit, list] = defaultdict(list)
    for file, entries in plan:
        for hf_key, target in entries:
            inputs[(alias[target.key], target.expert)].append((file, hf_key, target.rows))
    if fp8:
        spec.weights.convert_to_fp8_base(model, "dequant")  # the meta model: which weights are written in e4m3
    out_state = model.state_dict()
    parts = _output_parts(out_state, adapter)
    merger = _Merger(files, state, out_state, inputs, deltas, parts)
    target = {"overwrite": overwrite, "sources": sources, "what": "OUT_DIR"}
    with output_dir(out_dir, **target) as tmp:
        shards = shard_plan(adapter, out_state, None, parse_size(max_shard_size))
        weight_map, total = _write_shards(tmp, shards, merger)
        write_metadata(fmt.hf_config(args), tmp, shards, weight_map, total, fmt.model_dtype(model), base_dir, fp8)
    return list(merger.errors.values())


def _base(spec: ModelSpec, base_dir: Path, dtype: torch.dtype):
    """(the family's `HfFormat`, BASE_DIR's args, its files, the model on meta in `dtype` as the loader
    builds it, the read plan), with the loader's refusals (an incomplete checkpoint, a tensor of another
    shape) made before anything is written."""
    fmt = spec.hf_format
    if fmt is None:
        raise ValueError(f"{base_dir}: the {spec.family.name} family's checkpoints have no HF format glmtune merges")
    args = fmt.read_config(base_dir)
    files = checkpoint_files(base_dir)
    check_shard_sizes(files)
    model = fmt.build_meta(args, dtype)
    state = model.state_dict(keep_vars=True)
    adapter = fmt.adapter(args)
    plan = read_plan(files, adapter, state.keys())
    check_complete({key: tuple(tensor.shape) for key, tensor in state.items()}, plan, adapter)
    _check_shapes(files, plan, state)
    return fmt, args, files, model, plan


def _return_freed_memory() -> None:
    """Serve blocks of 4 MB and more from their own mappings, unmapped when freed. glibc's
    default raises that threshold to the largest block freed so far (up to 32 MB), after which
    each unit's temporaries come from the heap between the shard's longer-lived tensors, and
    the heap, fragmented, grows with every unit: 2.8x the bound on a 1 GB merge with --fp8.
    (A lower threshold costs page faults: 256 KB made that merge twice as slow.)"""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc; elsewhere nothing to do
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def _aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each state key -> the first key of the same tensor (a tied LM head -> the embedding)."""
    first: dict[int, str] = {}
    return {key: first.setdefault(id(tensor), key) for key, tensor in state.items()}


def _check_shapes(files: dict[str, Path], plan, state: dict[str, torch.Tensor]) -> None:
    """The loader's shape refusals (`load_state_into`), from the shard headers, before any write."""
    headers = {file: read_header(file)[0] for file in sorted(set(files.values()))}
    for file, entries in plan:
        for hf_key, target in entries:
            entry = headers[file].get(hf_key)
            if entry is None:
                continue  # reading it fails with the loader's message
            shape = tuple(entry["shape"])
            if entry["dtype"] in _FP8_HEADER_DTYPES:
                scale_key = fp8_scale_key(files, file, hf_key)
                try:
                    check_fp8_scale(shape, tuple(headers[files[scale_key]][scale_key]["shape"]))
                except ValueError as exc:
                    raise ValueError(f"{file}: {hf_key}: {exc}") from None
            dest, _ = tensor_destination(state, target)
            if shape != tuple(dest.shape):
                raise ValueError(f"{file}: tensor {hf_key} has shape {shape}, "
                                 f"the model expects {tuple(dest.shape)}")


def _output_parts(state: dict[str, torch.Tensor], adapter) -> dict[str, _Part]:
    """HF key -> where its tensor comes from, read off the adapter's own views of the meta state
    (an expert's gate and up rows, and their scales' rows, are where `to_hf` slices them)."""
    parts = {}
    for key, tensor in state.items():
        if key in adapter.tied_keys:
            continue
        weight_key = key.removesuffix(SCALE_SUFFIX)
        for hf_key, part in adapter.to_hf(key, tensor):
            if part.dim() == tensor.dim():
                parts[hf_key] = _Part(key, (weight_key, None), None)
                continue
            expert, within = divmod(part.storage_offset(), tensor.stride(0))
            row = within // tensor.stride(1)
            parts[hf_key] = _Part(key, (weight_key, expert), (row, row + part.shape[0]))
    return parts


class _Merger:
    """Computes units: read from the base, merged, re-quantized, cut into their HF tensors."""

    def __init__(self, files, state, out_state, inputs, deltas, parts: dict[str, _Part]) -> None:
        self.files, self.state, self.out_state = files, state, out_state
        self.inputs, self.deltas, self.parts = inputs, deltas, parts
        self.unit_keys: dict[Unit, list[str]] = defaultdict(list)
        for hf_key, part in parts.items():
            self.unit_keys[part.unit].append(hf_key)
        self.errors: dict[str, tuple[float, float]] = {}
        self._file, self._handle = None, None

    def tensors(self, unit: Unit) -> dict[str, torch.Tensor]:
        """HF key -> host tensor (as written) of every part of `unit`."""
        key, expert = unit
        merged = self._merged(unit)
        results = {key: merged}
        if is_fp8(self.out_state[key]):
            results[key], results[key + SCALE_SUFFIX], (unit_error, unit_norm) = \
                fp8_blocks.quantize_weight_with_error(merged)
            error, norm = self.errors.get(key, (0.0, 0.0))
            self.errors[key] = (error + unit_error, norm + unit_norm)
        out = {}
        for hf_key in self.unit_keys[unit]:
            part = self.parts[hf_key]
            tensor = results[part.key] if part.rows is None else results[part.key][part.rows[0] : part.rows[1]]
            out[hf_key] = host_copy(tensor, tensor.dtype)
        return out

    @torch.no_grad()
    def _merged(self, unit: Unit) -> torch.Tensor:
        """The unit in the base dtype as the loader fills it, plus its deltas, as the merge adds them."""
        key, expert = unit
        meta = self.state[key] if expert is None else self.state[key][expert]
        merged = torch.empty(meta.shape, dtype=meta.dtype)
        for file, hf_key, rows in self.inputs[unit]:
            (merged if rows is None else merged[rows[0] : rows[1]]).copy_(self._read(file, hf_key))
        for delta in self.deltas.get(key, ()):
            delta.add_to(merged, expert)
        return merged

    def _read(self, file: Path, hf_key: str) -> torch.Tensor:
        """A base tensor (FP8 dequantized in fp32); one shard file mapped at a time."""
        if file != self._file:
            self._file, self._handle = None, None  # unmap the previous shard first
            self._file, self._handle = file, open_shard(file)
        tensor = read_tensor(self._handle, file, hf_key)
        if not is_fp8(tensor):
            return tensor
        scale_key = fp8_scale_key(self.files, file, hf_key)
        scale = read_tensor(open_shard(self.files[scale_key]), self.files[scale_key], scale_key)
        return dequantize_fp8_block(tensor, scale, torch.float32)


def _write_shards(tmp: Path, shards: list[list[tuple[str, torch.dtype]]], merger: _Merger) -> tuple[dict, int]:
    """Each planned shard file, written as soon as its tensors are merged; (weight map, bytes)."""
    size = sum(cast.itemsize * _numel(merger, hf_key) for shard in shards for hf_key, cast in shard)
    return write_planned_shards(tmp, shards, lambda key: merger.tensors(merger.parts[key].unit), size, "merging")


def _numel(merger: _Merger, hf_key: str) -> int:
    part = merger.parts[hf_key]
    key, expert = part.unit
    tensor = merger.out_state[part.key] if expert is None else merger.out_state[part.key][expert]
    return tensor[part.rows[0] : part.rows[1]].numel() if part.rows else tensor.numel()
