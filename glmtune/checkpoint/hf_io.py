"""Hugging Face checkpoint directories in and out (safetensors, sharded or not).

`load_pretrained` builds the model on the meta device, materializes it once on the
target device, then streams tensors shard by shard into it, so host memory holds
the model plus one tensor (safetensors maps files lazily), never the state dict
twice. Per-expert tensors are written straight into the stacked expert
parameters, FP8 block-quantized weights are dequantized on the way, and MTP
layers are kept. Any missing, unexpected or mis-shaped tensor, and any missing or
unreadable shard, is a one-line `ValueError`/`FileNotFoundError` naming the key
and the file, said before the model is allocated (`hf_verify.check_loadable`: the headers
against the meta-device model of config.json), so a config.json claiming sizes its weights
do not have never allocates them.

`save_pretrained` writes the same layout transformers writes (per-expert keys,
`model.safetensors.index.json` when sharded, config.json), in the parameters' dtype
or in an explicit `dtype` (a run with fp32 master weights exports in `model.dtype`,
the dtype it computed in and its base checkpoint's), cast one shard at a time, through
`glmtune.io.outputs.output_dir`: built in a temporary sibling directory, made visible
in one step when complete, with the user's normal file permissions; never over an
input (`source_dir`, `sources`).

Knows no family: what it needs of one (config.json read and written, the HF names of the
state-dict adapter, the model on meta) is the family's `HfFormat` (models/common/hf_format.py),
which its spec hands over with the args; GLM-5's is glmtune/models/glm5/hf_format.py, wired in
its spec. The FP8 block-scale layout is checkpoint/fp8_layout.py's, the same for every family.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from glmtune.checkpoint.fp8_layout import (
    FP8_BLOCK,
    FP8_QUANTIZATION_CONFIG,
    SCALE_SUFFIX,
    check_fp8_scale,
    dequantize_fp8_block,
    is_fp8,
)
from glmtune.checkpoint.hf_verify import BLOCKING_KINDS, INDEX_NAME, SINGLE_NAME, check_loadable, read_index
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.checkpoint.shard_paths import outside_reason, shard_file, view_source
from glmtune.distributed.pipeline_state import gathered_to_rank0, pipeline_entries
from glmtune.io.outputs import check_output, output_dir
from glmtune.io.regular import kind_of
from glmtune.io.sizes import parse_size
from glmtune.kernels import fp8_blocks
from glmtune.models.common.hf_format import HfFormat, StateDictAdapter, Target

# Files a serving stack needs besides the weights; copied from the source directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """HF key -> shard file, from the index (sharded) or the single safetensors file.

    Every file named stays inside `path` (shard_paths.py): a name that leaves it is a
    ValueError naming the index and the entry, before any file is opened."""
    path = Path(path)
    index = path / INDEX_NAME
    if os.path.exists(index):  # a link to nothing: as if there were none
        try:
            parsed = read_index(index)
        except ValueError as exc:
            raise ValueError(f"{index}: {exc}") from None
        weight_map = parsed["weight_map"]
        files, checked, source = {}, {}, view_source(parsed)
        for key, name in weight_map.items():
            if not isinstance(name, str) or name not in checked:  # raises for all but a name inside `path`:
                checked[name] = shard_file(path, name, index, key, source)
            files[key] = checked[name]
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard named in {INDEX_NAME} is missing")
        return files
    single = path / SINGLE_NAME
    if os.path.lexists(single):
        reason = outside_reason(path, SINGLE_NAME)
        if reason:  # a FIFO or a device named for what it is (it is never opened)
            kind = kind_of(single)
            raise ValueError(f"{single} is {kind}, not a regular file: a reader would wait on it forever"
                             if kind in BLOCKING_KINDS else f"{single} {reason}")
        try:
            header, _ = read_header(single)
        except ValueError as exc:
            raise ValueError(f"{single}: {exc}") from None
        return dict.fromkeys(header, single)
    raise FileNotFoundError(f"{path}: no {INDEX_NAME} or {SINGLE_NAME}")


def open_shard(file: Path):
    """A safetensors handle on `file` (CPU tensors); a corrupt or truncated file is a
    ValueError naming it, not safetensors' own error."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for bad headers
        raise ValueError(f"{file}: unreadable safetensors file (truncated or corrupt): {exc}") from None


def read_tensor(handle, file: Path, key: str) -> torch.Tensor:
    """Tensor `key` from `handle` (`open_shard(file)`); a read that fails is a ValueError
    naming `file` and `key`."""
    try:
        return handle.get_tensor(key)
    except Exception as exc:
        raise ValueError(f"{file}: cannot read tensor {key} (truncated or corrupt file): {exc}") from None


def load_pretrained(path: str | Path, fmt: HfFormat, build: Callable[[Any], nn.Module]) -> nn.Module:
    """Load a local HF directory (config.json + safetensors) of the family `fmt` describes.

    `build(args)` makes the model of config.json's args (`fmt.read_config`) where and in the dtype
    it is to live, its weights uninitialized: each tensor of the files is copied in. A model built
    with a frozen FP8 base (weights in e4m3 with `<key>_scale_inv` block scales beside them) takes
    FP8 tensors of the checkpoint with their block scales as they are and quantizes bf16 ones;
    any other model gets FP8 tensors dequantized."""
    path = Path(path)
    args = fmt.read_config(path)
    files = checkpoint_files(path)
    check_loadable(path, fmt, args)  # every header against the config, before the model is allocated
    model = build(args)
    load_state_into(model, files, fmt.adapter(args))
    return model


def check_shard_sizes(files: dict[str, Path]) -> None:
    """A shard cut short (an interrupted copy), or one safetensors would refuse, is caught
    before any tensor is read (`read_header` checks the file's size against its header)."""
    for file in sorted(set(files.values())):
        try:
            read_header(file)
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None


@torch.no_grad()
def load_state_into(model: nn.Module, files: dict[str, Path], adapter: StateDictAdapter) -> None:
    """Fill `model` with the tensors of `files` (`checkpoint_files`), named by its family's `adapter`."""
    state = model.state_dict()
    plan = read_plan(files, adapter, state.keys())
    check_complete({key: tuple(tensor.shape) for key, tensor in state.items()}, plan, adapter)
    for file, entries in plan:
        handle = open_shard(file)
        for hf_key, target in entries:
            tensor = read_tensor(handle, file, hf_key)
            scale = None
            if is_fp8(tensor):
                scale_key = fp8_scale_key(files, file, hf_key)
                scale = read_tensor(open_shard(files[scale_key]), files[scale_key], scale_key)
                try:
                    check_fp8_scale(tuple(tensor.shape), tuple(scale.shape))
                except ValueError as exc:
                    raise ValueError(f"{file}: {hf_key}: {exc}") from None
            dest, dest_scale = tensor_destination(state, target)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"{file}: tensor {hf_key} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            if dest_scale is None:  # a bf16/fp32 model tensor
                dest.copy_(tensor if scale is None else dequantize_fp8_block(tensor, scale, torch.float32))
                continue
            if target.rows is not None and target.rows[0] % FP8_BLOCK:
                raise ValueError(f"{file}: {hf_key}: an FP8 base keeps gate and up rows in separate "
                                 f"{FP8_BLOCK}-row blocks; moe_intermediate_size {target.rows[1] - target.rows[0]} "
                                 f"is not a multiple of {FP8_BLOCK}")
            if scale is None:  # a bf16 checkpoint tensor onto an FP8 base: quantized here
                tensor, scale = fp8_blocks.quantize_weight(tensor)
            dest.copy_(tensor)
            dest_scale.copy_(scale)


def tensor_destination(state: dict[str, torch.Tensor],
                       target: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model tensor (slice) an HF tensor fills and, on a frozen FP8 base, the slice of
    block scales that goes with it (None for a bf16/fp32 tensor)."""
    dest = state[target.key]
    scales = state.get(target.key + SCALE_SUFFIX) if is_fp8(dest) else None
    if target.expert is not None:
        dest = dest[target.expert]
        scales = None if scales is None else scales[target.expert]
        if target.rows is not None:
            dest = dest[target.rows[0] : target.rows[1]]
            if scales is not None:
                scales = scales[target.rows[0] // FP8_BLOCK : -(-target.rows[1] // FP8_BLOCK)]
    assert not is_fp8(dest) or scales is not None, target
    return dest, scales


ReadPlan = list[tuple[Path, list[tuple[str, Target]]]]


def read_plan(files: dict[str, Path], adapter: StateDictAdapter, model_keys) -> ReadPlan:
    """(file, [(HF key, its target in the model)]) file by file, in a fixed order (the same on
    every rank); FP8 scales are left out (read with their weight: `fp8_scale_key`).

    Raises ValueError naming the file and the key for a tensor the model has no place for.
    The sharded loader (glmtune/checkpoint/sharded_load.py) reads the same plan.
    """
    model_keys = set(model_keys)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, file in files.items():
        by_file[file].append(key)
    plan: ReadPlan = []
    for file, keys in sorted(by_file.items()):
        entries = []
        for hf_key in sorted(keys):
            if hf_key.endswith(SCALE_SUFFIX):
                if hf_key[: -len(SCALE_SUFFIX)] not in files:
                    raise ValueError(f"{file}: unexpected tensor {hf_key} (no weight it scales)")
                continue
            target = adapter.from_hf_key(hf_key)
            if target is None or target.key not in model_keys:
                raise ValueError(f"{file}: unexpected tensor {hf_key} (not part of this model's config)")
            entries.append((hf_key, target))
        plan.append((file, entries))
    return plan


def fp8_scale_key(files: dict[str, Path], file: Path, hf_key: str) -> str:
    """The HF key of an FP8 weight's block scales; ValueError naming the file when absent."""
    scale_key = hf_key + SCALE_SUFFIX
    if scale_key not in files:
        raise ValueError(f"{file}: FP8 tensor {hf_key} has no {scale_key}")
    return scale_key


def check_complete(shapes: dict[str, tuple[int, ...]], plan: ReadPlan, adapter: StateDictAdapter) -> None:
    """Every model tensor (`shapes`: key -> global shape) is filled by the plan: each HF tensor
    the adapter stores it as (each expert of a stacked expert tensor) is read; a tied one is not
    stored, and FP8 scales come with their weights. ValueError naming the first missing HF key."""
    planned = {hf_key for _, entries in plan for hf_key, _ in entries}
    missing = [hf_key for key, shape in shapes.items()
               if key not in adapter.tied_keys and not key.endswith(SCALE_SUFFIX)
               for hf_key, _ in adapter.to_hf(key, torch.empty(shape, device="meta")) if hf_key not in planned]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]}{more}")


def hf_tensors(state: dict[str, torch.Tensor], adapter: StateDictAdapter):
    """(HF key, tensor) for every tensor a checkpoint of the model whose state is `state` holds,
    in model order (a tied tensor is not held)."""
    for key, tensor in state.items():
        if key not in adapter.tied_keys:
            yield from adapter.to_hf(key, tensor)


def written_dtypes(fmt: HfFormat, args: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """HF key -> the dtype a model of `args` built in `dtype` holds the tensor in (GLM-5's routers
    stay fp32), read off the model on the meta device (no memory)."""
    reference = fmt.build_meta(args, dtype)
    return {key: tensor.dtype for key, tensor in hf_tensors(reference.state_dict(), fmt.adapter(args))}


@torch.no_grad()  # no autograd graph: a gathered tensor is freed as soon as it is dropped
def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (FSDP2 and EP shards; a collective, every rank calls it in
    the same order), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def meta_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state`'s global shapes and dtypes on the meta device (a DTensor's without a gather)."""
    return {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in state.items()}


def shard_plan(adapter: StateDictAdapter, state: dict[str, torch.Tensor],
               written: dict[str, torch.dtype] | None, limit: int) -> list[list[tuple[str, torch.dtype]]]:
    """`plan_shards` of a model's tensors (`state`, named by its family's `adapter`), from global
    shapes on the meta device: no gather."""
    return plan_shards(hf_tensors(meta_state(state), adapter), written, limit)


def plan_shards(items: Iterable[tuple[str, torch.Tensor]], written: dict[str, torch.dtype] | None,
                limit: int) -> list[list[tuple[str, torch.dtype]]]:
    """(HF key, dtype as written) of every (HF key, tensor) of `items`, in order, grouped into
    shard files of at most `limit` bytes as written (a larger tensor alone); `written`: HF key
    -> the dtype it is written in (None: its own)."""
    shards: list[list[tuple[str, torch.dtype]]] = [[]]
    size = 0
    for key, tensor in items:
        cast = tensor.dtype if written is None else written[key]
        nbytes = tensor.numel() * cast.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, cast))
        size += nbytes
    return shards


def shard_names(num_shards: int) -> list[str]:
    """The file names of a checkpoint written in `num_shards` shard files, as transformers names them."""
    if num_shards == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_shard(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(file), metadata={"format": "pt"})


def write_planned_shards(tmp: Path, shards: list[list[tuple[str, torch.dtype]]],
                         produce: Callable[[str], dict[str, torch.Tensor]], total_bytes: int, label: str
                         ) -> tuple[dict[str, str], int]:
    """Write each shard of `shard_plan`'s plan as soon as its tensors exist, and free them; the
    streaming export and merge both write this way. `produce(hf_key)` returns every tensor of
    the unit `hf_key` belongs to (those of later shards are kept until their shard is written).
    Returns (weight map, bytes written); a progress bar in bytes (`label`) on a terminal."""
    names = shard_names(len(shards))
    weight_map, total, ready = {}, 0, {}
    console = Console(stderr=True)
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=total_bytes)
        for i, shard in enumerate(shards):
            pending = {}
            for hf_key, cast in shard:
                if hf_key not in ready:
                    ready.update(produce(hf_key))
                pending[hf_key] = ready.pop(hf_key)
                assert pending[hf_key].dtype == cast, hf_key
            write_shard(tmp / names[i], pending)
            written = sum(t.numel() * t.element_size() for t in pending.values())
            weight_map.update(dict.fromkeys(pending, names[i]))
            total += written
            progress.advance(task, written)
            del pending
    assert not ready, "every tensor of a produced unit written"
    return weight_map, total


def host_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on the CPU in `dtype`, owning exactly its bytes: a slice of a stacked expert
    tensor is copied out, so keeping it never keeps the whole stack alive."""
    out = tensor.detach().to("cpu", dtype).contiguous()
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()
    return out


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    fmt: HfFormat,
    args: Any,
    max_shard_size: int | str = "5GB",
    source_dir: str | Path | None = None,
    overwrite: bool = True,
    sources: tuple[tuple[str, str | Path], ...] = (),
    dtype: torch.dtype | None = None,
    pp_group=None,
) -> Path:
    """Write an HF directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Under FSDP2 and EP call it on every rank: tensors are gathered one at a time, in state
    dict order (every rank takes part in each gather), and rank 0 writes each shard file as
    soon as its last tensor arrives, then frees it. Rank 0 holds at most one shard file's
    tensors plus the tensor being gathered (a stacked routed-experts tensor is gathered
    whole, then split into per-expert keys); the others hold one gathered tensor at a time.

    Args:
        fmt, args: the model's family's `HfFormat` and the model's args (its HF names, its
            config.json).
        max_shard_size: bytes or a string like "5GB"; tensors are never split.
        source_dir: the checkpoint the model came from; its tokenizer and chat-template
            files are copied alongside.
        overwrite: replace an existing non-empty `path` (atomically). The default keeps
            re-exports of a run's own `hf/` working; pass False for a user-named path.
        sources: (label, path) of inputs `path` must not be, be inside or contain
            (`source_dir` is always one), even with `overwrite`.
        dtype: write the tensors and config.json's dtype as a model built in `dtype`
            holds them (GLM-5's routers stay fp32, as in transformers); under fp32 master
            weights pass `model.dtype`'s. Each tensor is cast as it is gathered. None: as
            the parameters are.
        pp_group: under pipeline parallelism, the pp group: each stage's tensors are
            gathered within the stage and sent to rank 0 (`glmtune.distributed.pipeline_state`).
    """
    import torch.distributed as dist

    path = Path(path)
    limit = parse_size(max_shard_size)
    if source_dir is not None:
        sources = (*sources, ("source_dir", source_dir))
    target = {"overwrite": overwrite, "sources": sources, "what": "path", "option": "overwrite=True"}
    check_output(path, **target)  # on every rank, before the collectives: a refusal never hangs the others
    distributed = dist.is_available() and dist.is_initialized()
    writes = not distributed or dist.get_rank() == 0
    state = model.state_dict()  # FSDP2 keeps the names; sharded parameters are DTensors
    adapter = fmt.adapter(args)
    written = None if dtype is None else written_dtypes(fmt, args, dtype)
    plan, items = _plan_and_items(state, adapter, written, limit, pp_group)
    with (output_dir(path, **target) if writes else contextlib.nullcontext()) as tmp:
        weight_map, total = _write_gathered(items, adapter, plan, tmp if writes else None)
        if writes:
            fp8 = any(is_fp8(tensor) for tensor in state.values())
            named = fmt.model_dtype(model) if fp8 or dtype is None else dtype  # an FP8 base: the model's
            write_metadata(fmt.hf_config(args), tmp, plan, weight_map, total, named, source_dir, fp8)
    if distributed:
        dist.barrier()  # the other ranks return once the export is complete
    return path


def _plan_and_items(state: dict[str, torch.Tensor], adapter: StateDictAdapter,
                    written: dict[str, torch.dtype] | None, limit: int, pp_group):
    """(the shard plan, (key, full tensor) of every state tensor, each gathered as it is reached)."""
    if pp_group is not None:  # every stage's tensors, each gathered onto rank 0 in turn
        everything = {key: torch.empty(shape, dtype=dt, device="meta")
                      for key, shape, dt, _ in pipeline_entries(state, pp_group)}
        device = next((t.device for t in state.values() if t.device.type != "meta"), torch.device("cpu"))
        return shard_plan(adapter, everything, written, limit), gathered_to_rank0(state, pp_group, device)
    return shard_plan(adapter, state, written, limit), ((key, _gathered(tensor)) for key, tensor in state.items())


def _write_gathered(items, adapter: StateDictAdapter, plan: list[list[tuple[str, torch.dtype]]],
                    tmp: Path | None) -> tuple[dict[str, str], int]:
    """Write each shard of `plan` into `tmp` as soon as its last tensor of `items` arrives, and free
    it; (weight map, bytes written). `tmp` None: a rank that only takes part in the gathers."""
    names = shard_names(len(plan))
    shard_of = {key: (i, cast) for i, shard in enumerate(plan) for key, cast in shard}
    weight_map, total, pending = {}, 0, {}
    for key, full in items:
        if key in adapter.tied_keys:
            continue
        if tmp is None:
            del full
            continue
        for hf_key, part in adapter.to_hf(key, full):  # a view of `full`, copied out
            i, cast = shard_of[hf_key]
            pending[hf_key] = host_copy(part, cast)
            if len(pending) == len(plan[i]):  # the shard's last tensor: write it, free it
                write_shard(tmp / names[i], pending)
                for name, t in pending.items():
                    weight_map[name] = names[i]
                    total += t.numel() * t.element_size()
                pending = {}
            del part
        del full
    assert tmp is None or (not pending and len(weight_map) == len(shard_of)), "every planned tensor written"
    return weight_map, total


def write_metadata(config: dict[str, Any] | None, tmp: Path, plan, weight_map, total: int, dtype: torch.dtype,
                   source_dir, fp8: bool) -> None:
    """The index (when sharded), config.json (the family's `config`, in `dtype`: the dtype the
    model computes in; with `fp8`, FP8 block-quantized weights described as DeepSeek-V3's are; None:
    the caller wrote its own) and `source_dir`'s tokenizer files, beside the shards in `tmp`."""
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        _write_config(config, tmp, dtype, fp8)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, tmp / name)


def _write_config(config: dict[str, Any], tmp: Path, dtype: torch.dtype, fp8: bool) -> None:
    """config.json: the family's `config` in `dtype` (`write_metadata`)."""
    config = {**config, "dtype": str(dtype).removeprefix("torch.")}
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)  # weights are written dequantized
    if fp8:  # a frozen FP8 base, or `glmtune merge --fp8`: e4m3 weights with 128x128 scales
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
