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
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from safetensors import safe_open
from safetensors.torch import save_file

from glmtune.checkpoint.hf_verify import BLOCKING_KINDS, INDEX_NAME, SINGLE_NAME, check_loadable, read_index
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.checkpoint.shard_paths import outside_reason, shard_file, view_source
from glmtune.distributed.pipeline_state import gathered_to_rank0, pipeline_entries
from glmtune.io.outputs import check_output, output_dir
from glmtune.io.regular import kind_of
from glmtune.io.sizes import parse_size
from glmtune.kernels import fp8_blocks
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import Glm5ForCausalLM, build_model
from glmtune.models.glm5.state_dict_adapter import (
    FP8_BLOCK,
    Glm5StateDictAdapter,
    SCALE_SUFFIX,
    Target,
    check_fp8_scale,
    dequantize_fp8_block,
    is_fp8,
)

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


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for bad headers
        raise ValueError(f"{file}: unreadable safetensors file (truncated or corrupt): {exc}") from None


def _read(handle, file: Path, key: str) -> torch.Tensor:
    try:
        return handle.get_tensor(key)
    except Exception as exc:
        raise ValueError(f"{file}: cannot read tensor {key} (truncated or corrupt file): {exc}") from None


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
    moe_backend: str = "grouped_mm",
    indexer_backend: str = "auto",
    fp8_base: str | None = None,
) -> Glm5ForCausalLM:
    """Load a local HF GLM-5 directory (config.json + safetensors) into a glmtune model.

    `fp8_base` (an FP8 matmul backend, `glmtune/kernels/fp8_matmul.py`) keeps the base frozen
    in FP8 (`glmtune/models/glm5/fp8_base.py`): FP8 tensors of the checkpoint are copied with
    their block scales as they are, bf16 ones are quantized; None dequantizes FP8 tensors."""
    path = Path(path)
    args = Glm5Args.from_hf_config(path)
    files = checkpoint_files(path)
    check_loadable(path, args)  # every header against the config, before the model is allocated
    model = build_model(args, dtype, device, attention_backend, moe_backend, init=False,
                        indexer_backend=indexer_backend, fp8_base=fp8_base)
    load_state_into(model, files)
    return model


def _check_shard_sizes(files: dict[str, Path]) -> None:
    """A shard cut short (an interrupted copy), or one safetensors would refuse, is caught
    before any tensor is read (`read_header` checks the file's size against its header)."""
    for file in sorted(set(files.values())):
        try:
            read_header(file)
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None


@torch.no_grad()
def load_state_into(model: Glm5ForCausalLM, files: dict[str, Path]) -> None:
    adapter = Glm5StateDictAdapter(model.args)
    state = model.state_dict()
    plan = read_plan(files, adapter, state.keys())
    check_complete(model.args, {key: tensor.shape for key, tensor in state.items()}, plan, adapter)
    for file, entries in plan:
        handle = _open(file)
        for hf_key, target in entries:
            tensor = _read(handle, file, hf_key)
            scale = None
            if is_fp8(tensor):
                scale_key = fp8_scale_key(files, file, hf_key)
                scale = _read(_open(files[scale_key]), files[scale_key], scale_key)
                try:
                    check_fp8_scale(tuple(tensor.shape), tuple(scale.shape))
                except ValueError as exc:
                    raise ValueError(f"{file}: {hf_key}: {exc}") from None
            dest, dest_scale = _destination(state, target)
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


def _destination(state: dict[str, torch.Tensor], target: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def read_plan(files: dict[str, Path], adapter: Glm5StateDictAdapter, model_keys) -> ReadPlan:
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


def check_complete(args: Glm5Args, shapes: dict[str, tuple[int, ...]], plan: ReadPlan,
                   adapter: Glm5StateDictAdapter) -> None:
    """Every model tensor (`shapes`: key -> global shape) is filled by the plan, each expert
    of a stacked expert tensor included; ValueError naming the first missing HF key."""
    filled: set[str] = set()
    expert_parts: dict[str, set] = defaultdict(set)
    for _, entries in plan:
        for _, target in entries:
            if target.expert is None:
                filled.add(target.key)
            else:
                expert_parts[target.key].add((target.expert, target.rows))
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    missing = []
    for key, shape in shapes.items():
        if key in filled or key in tied or key.endswith(SCALE_SUFFIX):  # FP8 scales come with their weights
            continue
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts_per_expert = 2 if key.endswith("gate_up_proj") else 1
            if len(expert_parts.get(key, ())) == shape[0] * parts_per_expert:
                continue
        missing.append(next(iter(adapter.to_hf(key, torch.empty(shape, device="meta"))))[0])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]}{more}")


def hf_tensors(model: Glm5ForCausalLM, state: dict[str, torch.Tensor] | None = None):
    """(HF key, tensor) for every tensor the checkpoint holds, in model order."""
    adapter = Glm5StateDictAdapter(model.args)
    state = model.state_dict() if state is None else state
    for key, tensor in state.items():
        if model.args.tie_word_embeddings and key == "lm_head.weight":
            continue
        yield from adapter.to_hf(key, tensor)


def written_dtypes(args: Glm5Args, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """HF key -> the dtype a model built in `dtype` holds the tensor in (the routers stay fp32),
    read off a model on the meta device (no memory)."""
    reference = build_model(args, dtype, device="meta")
    return {key: tensor.dtype for key, tensor in hf_tensors(reference)}


@torch.no_grad()  # no autograd graph: a gathered tensor is freed as soon as it is dropped
def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (FSDP2 and EP shards; a collective, every rank calls it in
    the same order), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def meta_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state`'s global shapes and dtypes on the meta device (a DTensor's without a gather)."""
    return {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in state.items()}


def shard_plan(model: Glm5ForCausalLM, state: dict[str, torch.Tensor],
                written: dict[str, torch.dtype] | None, limit: int) -> list[list[tuple[str, torch.dtype]]]:
    """`plan_shards` of a GLM-5 model's tensors (from global shapes on the meta device: no gather)."""
    return plan_shards(hf_tensors(model, meta_state(state)), written, limit)


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
    model: Glm5ForCausalLM,
    path: str | Path,
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
        max_shard_size: bytes or a string like "5GB"; tensors are never split.
        source_dir: the checkpoint the model came from; its tokenizer and chat-template
            files are copied alongside.
        overwrite: replace an existing non-empty `path` (atomically). The default keeps
            re-exports of a run's own `hf/` working; pass False for a user-named path.
        sources: (label, path) of inputs `path` must not be, be inside or contain
            (`source_dir` is always one), even with `overwrite`.
        dtype: write the tensors and config.json's dtype as a model built in `dtype`
            holds them (its routers stay fp32, as in transformers); under fp32 master
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
    written = None if dtype is None else written_dtypes(model.args, dtype)
    if pp_group is not None:  # every stage's tensors, each gathered onto rank 0 in turn

        everything = {key: torch.empty(shape, dtype=dt, device="meta")
                      for key, shape, dt, _ in pipeline_entries(state, pp_group)}
        plan = shard_plan(model, everything, written, limit)
        device = next((t.device for t in state.values() if t.device.type != "meta"), torch.device("cpu"))
        items = gathered_to_rank0(state, pp_group, device)
    else:
        plan = shard_plan(model, state, written, limit)
        items = ((key, _gathered(tensor)) for key, tensor in state.items())
    names = shard_names(len(plan))
    shard_of = {key: (i, cast) for i, shard in enumerate(plan) for key, cast in shard}
    adapter = Glm5StateDictAdapter(model.args)
    with (output_dir(path, **target) if writes else contextlib.nullcontext()) as tmp:
        weight_map, total, pending = {}, 0, {}
        for key, full in items:
            if model.args.tie_word_embeddings and key == "lm_head.weight":
                continue
            if not writes:
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
        if writes:
            assert not pending and len(weight_map) == len(shard_of), "every planned tensor written"
            fp8 = any(is_fp8(tensor) for tensor in state.values())
            write_metadata(model, tmp, plan, weight_map, total, dtype, source_dir, fp8)
    if distributed:
        dist.barrier()  # the other ranks return once the export is complete
    return path


# How GLM-5's (and DeepSeek-V3's) FP8 releases describe their weights in config.json.
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def write_metadata(model, tmp: Path, plan, weight_map, total: int, dtype, source_dir, fp8: bool) -> None:
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = model.args.to_hf_dict()
    config["dtype"] = str(dtype or model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)  # weights are written dequantized
    if fp8:  # a frozen FP8 base, or `glmtune merge --fp8`: e4m3 weights with 128x128 scales
        config["dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, tmp / name)
