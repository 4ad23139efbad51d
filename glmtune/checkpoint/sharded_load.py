"""Load an HF checkpoint into a parallelized model, each rank reading only its own slices.

`load_pretrained` (hf_io.py) materializes the whole model on every rank; GLM-5 does not fit
on one. Here the model is built on the meta device and parallelized first, so each
parameter is a DTensor (dense ones `Shard(0)` over the FSDP mesh; routed experts
`Shard(0)` over ep and again sharded by FSDP2 over the expert FSDP mesh, which DTensor
records as a `_StridedShard`). `load_sharded` then

- allocates only the local shards (`to_empty` on the rank's device),
- computes, from each DTensor's mesh and placements, which global indices the local shard
  holds along every dim (any composition of `Shard`/`_StridedShard`; checked against
  `compute_local_shape_and_global_offset`),
- streams the safetensors files one by one through the same read plan as `load_pretrained`
  (HF names and the per-expert -> stacked mapping stay in the family's state-dict adapter,
  which the spec passes in its `HfFormat`: this module knows no family), reading
  with `get_slice` only the bytes of those indices: an expert the rank does not hold is
  never read, and of an FP8 weight only the 128x128 blocks that cover the slice are
  dequantized,
- fills the persistent buffers (router correction biases, replicated: read whole) and
  recomputes the non-persistent ones (rope `inv_freq`; routed-token counts zeroed).

Host memory beyond the local shards is one slice at a time. The result is bit for bit the
local part of what `load_pretrained` loads. Errors (missing shard file, missing,
unexpected or mis-shaped tensor) are the same one-line ValueErrors, raised on every rank
alike before the local shards are allocated (they are decided from the index and the file
headers, which every rank reads: `hf_verify.check_loadable`), so no rank is left waiting in a
later collective.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import _get_shard_size_and_offsets, compute_local_shape_and_global_offset

from glmtune.checkpoint.hf_io import (
    open_shard,
    check_complete,
    checkpoint_files,
    fp8_scale_key,
    read_plan,
)
from glmtune.checkpoint.fp8_layout import FP8_BLOCK, SCALE_SUFFIX, check_fp8_scale, dequantize_fp8_region, is_fp8
from glmtune.checkpoint.hf_verify import check_loadable
from glmtune.models.common.hf_format import HfFormat
from glmtune.models.common.rope import RotaryEmbedding

log = logging.getLogger(__name__)
_PAGE = resource.getpagesize()


@dataclass
class LoadStats:
    """What one rank read and held while loading."""

    bytes_read: int = 0          # tensor bytes read from the safetensors files (FP8 scales included)
    checkpoint_bytes: int = 0    # tensor bytes of the whole checkpoint
    tensors_read: int = 0        # (partial) tensors read
    tensors_skipped: int = 0     # HF tensors this rank holds nothing of (other ranks' experts): not read
    files: int = 0
    seconds: float = 0.0
    start_rss_bytes: int = 0     # the process's resident memory before loading (torch and the meta model)
    peak_rss_bytes: int = 0      # ... and the highest seen after each read, slice still held
    peak_device_bytes: int | None = None  # torch.cuda.max_memory_allocated during the load (CUDA only)
    local_param_bytes: int = 0   # this rank's shards of the parameters and buffers

    def describe(self) -> str:
        gib = 2**30
        device = "" if self.peak_device_bytes is None else f", peak device {self.peak_device_bytes / gib:.2f} GiB"
        return (f"read {self.bytes_read / gib:.3f} of {self.checkpoint_bytes / gib:.3f} GiB "
                f"({self.tensors_read} slices, {self.files} files) in {self.seconds:.1f} s; local shards "
                f"{self.local_param_bytes / gib:.3f} GiB, peak host RSS {self.peak_rss_bytes / gib:.2f} GiB "
                f"(+{(self.peak_rss_bytes - self.start_rss_bytes) / gib:.3f} over the start){device}")


def local_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """For each dim, the global indices (ascending) this rank's local shard of `tensor` holds.

    Applies the placements mesh axis by mesh axis as DTensor does, `_StridedShard`
    (FSDP2 over an ep-sharded expert) included; a plain tensor holds everything.
    """
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    mesh, placements, shape = tensor.device_mesh, tensor.placements, tuple(tensor.shape)
    local_shape = list(shape)
    sharded: dict[int, torch.Tensor] = {}  # dim -> global indices held, once sharded on some axis
    for axis, placement in enumerate(placements):
        if not isinstance(placement, (Shard, _StridedShard)):  # Replicate; Partial never holds parameters
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(local_shape[dim], mesh.size(axis), mesh.get_local_rank(axis),
                                                    placement, sharded.get(dim), shape[dim], False)
        local_shape[dim] = size
        sharded[dim] = offsets if size else offsets[:0]  # an empty shard comes back as [dim size]
    indices = [sharded.get(dim, torch.arange(n)) for dim, n in enumerate(shape)]
    # The public answer (first offset, local shape) must agree with the index lists.
    public_shape, public_offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    assert tuple(public_shape) == tuple(len(i) for i in indices), (public_shape, [len(i) for i in indices])
    assert all(len(i) == 0 or int(i[0]) == o for i, o in zip(indices, public_offset)), (public_offset, indices)
    assert tuple(tensor.to_local().shape) == tuple(public_shape), (tensor.to_local().shape, public_shape)
    return indices


def _as_slice(index: torch.Tensor) -> slice | None:
    """index as a slice when it is a contiguous run (always, for the layouts FSDP2 and EP make)."""
    if len(index) == 0:
        return slice(0, 0)
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == len(index):
        return slice(first, last + 1)
    return None


def _read_region(handle, file: Path, hf_key: str, index: list[torch.Tensor], stats: LoadStats) -> torch.Tensor:
    """handle's tensor at the outer product of `index` (one list of global indices per dim),
    reading the bytes of the covering box only."""
    box = tuple(slice(int(i[0]), int(i[-1]) + 1) for i in index)
    try:
        part = handle.get_slice(hf_key)[box]
    except Exception as exc:  # safetensors raises its own error type
        raise ValueError(f"{file}: cannot read tensor {hf_key} (truncated or corrupt file): {exc}") from None
    stats.bytes_read += part.numel() * part.element_size()
    stats.tensors_read += 1
    if all(_as_slice(i) is not None for i in index):
        return part
    # A strided layout: keep the rows/cols of the box this rank holds.
    for dim, i in enumerate(index):
        part = part.index_select(dim, i - int(i[0]))
    return part


@torch.no_grad()
def load_sharded(model: nn.Module, hf_dir: str | Path, fmt: HfFormat, args: Any,
                 device: str | torch.device | None = None, not_in_checkpoint: set[str] = frozenset()) -> LoadStats:
    """Fill a meta-built, parallelized model from the HF directory `hf_dir`, each rank reading
    only its own shards. Call it on every rank after the family's parallelization (no collectives).

    Args:
        model: the family's model built on the meta device, its config the checkpoint's (the
            spec's `args_from_hf(hf_dir)`), then parallelized.
        fmt, args: the family's `HfFormat` (its state-dict adapter: HF key -> `Target`) and the
            model's args.
        device: where the local shards live; None: the current CUDA device when the
            parameters' mesh is on CUDA, else the CPU.
        not_in_checkpoint: state-dict keys the base checkpoint does not hold (LoRA adapters,
            `peft.init.adapter_parameter_names`): materialized but left for the caller to
            initialise (`reset_lora_parameters`).

    Returns the rank's `LoadStats` (also logged at INFO).
    Raises ValueError naming the file and the HF key for a missing shard file, a missing,
    unexpected, mis-shaped or unreadable tensor.
    """
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    device = torch.device(device) if device is not None else _default_device(model)
    try:
        files = checkpoint_files(hf_dir)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    check_loadable(hf_dir, fmt, args)  # every header against the config, before the shards are allocated
    adapter = fmt.adapter(args)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items() if key not in not_in_checkpoint}
    plan = read_plan(files, adapter, shapes)
    check_complete(shapes, plan, adapter)

    stats = LoadStats(files=len(plan), start_rss_bytes=_rss())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.to_empty(device=device)
    reset_non_persistent_buffers(model)
    state = model.state_dict()  # after to_empty: the materialized DTensors and buffers
    destinations = {key: (tensor, local_indices(tensor)) for key, tensor in state.items()
                    if key not in not_in_checkpoint}
    stats.local_param_bytes = sum(_local(t).numel() * t.element_size() for t, _ in destinations.values())
    for file, entries in plan:
        handle = open_shard(file)
        _check_header(handle, file, entries)
        for key in handle.keys():
            meta = handle.get_slice(key)
            stats.checkpoint_bytes += _numel(meta.get_shape()) * _itemsize(meta.get_dtype(), file, key)
        for hf_key, target in entries:
            tensor, index = destinations[target.key]
            load_tensor(handle, file, files, hf_key, target, tensor, index, stats)
            if is_fp8(tensor):  # a frozen FP8 base: the block scales are a parameter of their own
                _load_scales(handle, file, files, hf_key, target, destinations, stats)
        del handle
    stats.seconds = time.perf_counter() - start
    stats.peak_rss_bytes = max(stats.peak_rss_bytes, _rss())
    if device.type == "cuda":
        stats.peak_device_bytes = torch.cuda.max_memory_allocated(device)
    log.info("load_sharded %s: %s", hf_dir, stats.describe())
    return stats


def load_tensor(handle, file: Path, files: dict[str, Path], hf_key: str, target: Any, tensor: torch.Tensor,
                index: list[torch.Tensor], stats: LoadStats) -> None:
    """Read the part of the HF tensor `hf_key` (in the open safetensors `file`) that lands in
    this rank's shard of `tensor` (`index = local_indices(tensor)`) and copy it in. `target`: the
    adapter's `Target` of `hf_key` (key, expert index or None, rows of the stacked output dim or None)."""
    meta = handle.get_slice(hf_key)
    hf_shape = tuple(meta.get_shape())
    if target.expert is None:
        expected = tuple(tensor.shape)
        hf_index, local_pos = index, [torch.arange(len(i)) for i in index]
    else:
        expected = tuple(tensor.shape[1:])
        rows = target.rows or (0, tensor.shape[1])
        expected = (rows[1] - rows[0], *expected[1:])
        expert_pos = (index[0] == target.expert).nonzero().flatten()
        row_pos = ((index[1] >= rows[0]) & (index[1] < rows[1])).nonzero().flatten()
        hf_index = [index[1][row_pos] - rows[0], *index[2:]]
        local_pos = [expert_pos, row_pos, *[torch.arange(len(i)) for i in index[2:]]]
    if hf_shape != expected:
        raise ValueError(f"{file}: tensor {hf_key} has shape {hf_shape}, the model expects {expected}")
    if any(len(p) == 0 for p in local_pos):
        stats.tensors_skipped += 1  # another rank's expert: not read at all
        return
    if is_fp8(tensor):  # kept as stored; its scales are read by `_load_scales`
        if not meta.get_dtype().startswith("F8"):
            raise ValueError(f"{file}: {hf_key} is {meta.get_dtype()}; a sharded FP8 base loads FP8 checkpoints "
                             f"only (one process quantizes other weights on load)")
        part = _read_region(handle, file, hf_key, hf_index, stats)
    elif meta.get_dtype().startswith("F8"):
        part = _read_fp8(handle, file, files, hf_key, hf_shape, hf_index, stats)
    else:
        part = _read_region(handle, file, hf_key, hf_index, stats)
    stats.peak_rss_bytes = max(stats.peak_rss_bytes, _rss())  # the slice is still held: the high point
    local = _local(tensor)
    if target.expert is not None:
        part = part.unsqueeze(0)  # the one expert
    slices = [_as_slice(p) for p in local_pos]
    if all(s is not None for s in slices):
        local[tuple(slices)].copy_(part)
    else:
        grids = torch.meshgrid(*local_pos, indexing="ij")
        local.index_put_(tuple(grids), part.to(local.dtype))


def _load_scales(handle, file: Path, files, hf_key: str, target: Any, destinations, stats: LoadStats) -> None:
    """This rank's part of the block scales of the FP8 weight `hf_key`, into `<weight>_scale_inv`."""
    scale_key = fp8_scale_key(files, file, hf_key)
    scale_file = files[scale_key]
    scale_handle = handle if scale_file == file else open_shard(scale_file)
    try:
        check_fp8_scale(tuple(handle.get_slice(hf_key).get_shape()), tuple(scale_handle.get_slice(scale_key).get_shape()))
    except ValueError as exc:
        raise ValueError(f"{file}: {hf_key}: {exc}") from None
    rows = target.rows
    if rows is not None:
        if rows[0] % FP8_BLOCK:
            raise ValueError(f"{file}: {hf_key}: an FP8 base keeps gate and up rows in separate {FP8_BLOCK}-row "
                             f"blocks; moe_intermediate_size {rows[1] - rows[0]} is not a multiple of {FP8_BLOCK}")
        rows = (rows[0] // FP8_BLOCK, -(-rows[1] // FP8_BLOCK))
    scale_target = replace(target, key=target.key + SCALE_SUFFIX, rows=rows)  # the adapter's Target type
    scale, index = destinations[scale_target.key]
    load_tensor(scale_handle, scale_file, files, scale_key, scale_target, scale, index, stats)


def _read_fp8(handle, file: Path, files, hf_key: str, hf_shape, hf_index, stats: LoadStats) -> torch.Tensor:
    """Dequantize the slice with the scales of the 128x128 blocks that cover it."""
    scale_key = fp8_scale_key(files, file, hf_key)
    scale_file = files[scale_key]
    scale_handle = handle if scale_file == file else open_shard(scale_file)
    scale_meta = scale_handle.get_slice(scale_key)
    try:
        check_fp8_scale(hf_shape, tuple(scale_meta.get_shape()))
    except ValueError as exc:
        raise ValueError(f"{file}: {hf_key}: {exc}") from None
    weight = _read_region(handle, file, hf_key, hf_index, stats)
    first = [int(i[0]) for i in hf_index]
    blocks = [torch.arange(int(i[0]) // FP8_BLOCK, int(i[-1]) // FP8_BLOCK + 1) for i in hf_index]
    scale = _read_region(scale_handle, scale_file, scale_key, blocks, stats)
    if all(_as_slice(i) is not None for i in hf_index):
        return dequantize_fp8_region(weight, scale, (first[0], first[1]), torch.float32)
    # Strided rows/cols: dequantize element by element against the covering blocks.
    scale_rows = scale.float()[(hf_index[0] // FP8_BLOCK) - blocks[0][0]]
    scale_grid = scale_rows[:, (hf_index[1] // FP8_BLOCK) - blocks[1][0]]
    return weight.float() * scale_grid


def _check_header(handle, file: Path, entries) -> None:
    """Every tensor the index puts in `file` is in its header: checked on every rank, so a
    missing tensor fails them all, not only the ranks that hold its slice."""
    present = set(handle.keys())
    for hf_key, _ in entries:
        if hf_key not in present:
            raise ValueError(f"{file}: cannot read tensor {hf_key} (named in the index, not in the file)")


def reset_non_persistent_buffers(model: nn.Module) -> None:
    # `to_empty` leaves them uninitialized and no checkpoint holds them: the rope
    # frequencies are recomputed as `load_pretrained` does; counters start at zero.
    persistent = set(model.state_dict().keys())
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    for name, buffer in model.named_buffers():
        if name not in persistent and not name.endswith("inv_freq"):
            buffer.zero_()


def _default_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        if isinstance(param, DTensor) and param.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _itemsize(dtype: str, file: Path, key: str) -> int:
    if dtype not in _ITEMSIZE:
        raise ValueError(f"{file}: tensor {key} is {dtype}, a dtype no checkpoint glmtune loads stores")
    return _ITEMSIZE[dtype]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE
