"""Merging LoRA adapters into base weights: in memory, or from an adapter directory.

`merge_lora(model)` folds the adapters of a model that `apply_lora` transformed into
its base weights and puts plain modules back, so `save_pretrained` writes an ordinary
HF checkpoint. `merge_adapter_dir(model, ADAPTER_DIR)` adds the deltas an exported
adapter directory describes (either layout of `adapter_export.py`) to a plain model;
`merge_to_dir` is `glmtune merge BASE_DIR ADAPTER_DIR OUT_DIR`, written shard by shard
(`merge_stream.py`: the same files as loading the base whole, merging and saving it, in about
one input shard + one output shard + the adapter of host memory): it never writes over
BASE_DIR or ADAPTER_DIR, replaces a non-empty OUT_DIR only with `overwrite`, and checks
that BASE_DIR is the base the adapter records in glmtune_adapter.json (`check_base`).

Deltas are computed in fp32 and added to the fp32 value of the base weight, then
rounded once to the base dtype. Adapter keys are HF names: an MTP layer's
(`model.layers.{L + j}.*`) are resolved to its in-memory modules (`mtp.{j}.*`) by the
state-dict adapter, so its adapters fold into the MTP layer's weights.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from glmtune.checkpoint.fingerprint import identity_mismatch
from glmtune.checkpoint.hf_io import check_shard_sizes, open_shard, read_tensor
from glmtune.io.outputs import check_output
from glmtune.io.text_limits import parse_json
from glmtune.models.common.hf_config import read_hf_config
from glmtune.models.registry import hf_dir_identity
from glmtune.peft.adapter_export import CONFIG_NAME, META_NAME, PREFIX, WEIGHTS_NAME, peft_match
from glmtune.peft.family import internal_prefix, spec_of
from glmtune.peft.lora import EXPERT_PARAMS, LoRALinear, lora_modules
from glmtune.peft.merge_stream import stream_merge

PER_EXPERT_RE = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
FUSED_EXPERTS_RE = re.compile(r"^(.+\.mlp\.experts)(\.base_layer)?$")
_KEY_RE = re.compile(r"^(.+)\.lora_([AB])\.weight$")


@torch.no_grad()
def _add_(param: torch.Tensor, delta: torch.Tensor) -> None:
    param.copy_((param.float() + delta.to(param.device)).to(param.dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain modules, in place.

    Returns the same model, now without LoRA modules (its parameters keep their
    `requires_grad` flags, i.e. frozen).
    """
    for name, module in lora_modules(model):
        if isinstance(module, LoRALinear):
            _add_(module.weight, module.delta_weight())
        else:
            for proj in module.targets:
                _add_(getattr(module, proj), module.delta_weight(proj))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.base_module())
    return model


def read_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the tensors (keys without the `base_model.model.` prefix).

    Either file hostile (cut short, not safetensors, not JSON, fields of the wrong type) is a
    ValueError naming the file (`read_adapter_config`, `read_adapter_weights`)."""
    config = read_adapter_config(adapter_dir)
    return config, read_adapter_weights(adapter_dir)


def read_adapter_weights(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, its header and size checked before a tensor is read."""
    file = Path(adapter_dir) / WEIGHTS_NAME
    check_shard_sizes({WEIGHTS_NAME: file})  # not safetensors, or cut short: named, before safetensors reads it
    handle = open_shard(file)
    return {key.removeprefix(PREFIX): read_tensor(handle, file, key) for key in handle.keys()}


def _config_problem(config: dict) -> str | None:
    """The first field of an adapter config merging reads that is not of its type (None if none)."""
    rank, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_parameters")
    if type(rank) is not int or rank <= 0:
        return f"r is {rank!r:.40}, not a positive integer"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        return f"lora_alpha is {alpha!r:.40}, not a number"
    if not isinstance(config.get("use_rslora", False), bool):
        return "use_rslora is not true or false"
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        return "target_parameters is not a list of names"
    return None


def read_adapter_config(adapter_dir: str | Path) -> dict:
    """adapter_config.json, checked for what merging supports (the weights file must exist)."""
    adapter_dir = Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (adapter_dir / name).is_file():
            raise FileNotFoundError(f"{adapter_dir}: no {name} (not a PEFT adapter directory)")
    config = parse_json((adapter_dir / CONFIG_NAME).read_bytes(), str(adapter_dir / CONFIG_NAME), max_bytes=1 << 20)
    if not isinstance(config, dict):
        raise ValueError(f"{adapter_dir / CONFIG_NAME}: not an adapter config (a JSON object)")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r:.40} is not LORA")
    problem = _config_problem(config)
    if problem:
        raise ValueError(f"{adapter_dir / CONFIG_NAME}: {problem}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("lora_bias", False)):
        if config.get(key, ok) != ok:
            raise ValueError(f"{adapter_dir}: {key}={config[key]!r:.40} is not supported (expected {ok!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"{adapter_dir}: {key} is not supported by glmtune merge")
    return config


def lora_pairs(adapter_dir: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """stem -> {"A": lora_A, "B": lora_B} in fp32; ValueError naming the adapter file for a tensor that
    is not a LoRA factor, a factor without its partner, or a pair that is not two matrices of one rank."""
    where = Path(adapter_dir) / WEIGHTS_NAME
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key} is not a LoRA factor (lora_A/lora_B weight)")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{where}: {key} is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, "
                             "not a matrix of floating-point numbers")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor.float()
    for stem, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {stem} has lora_{next(iter(pair))} but no partner factor")
        if pair["A"].shape[0] != pair["B"].shape[1]:
            raise ValueError(f"{where}: {stem}: lora_A has {pair['A'].shape[0]} rows, lora_B "
                             f"{pair['B'].shape[1]} columns (one rank for both)")
    return pairs


def fused_expert_proj(stem: str, inner: bool, config: dict) -> str:
    """Which stacked parameter a PEFT ParamWrapper key adapts (see adapter_export.py for the nesting)."""
    targeted = [p for p in EXPERT_PARAMS if peft_match(f"{stem}.{p}", config.get("target_parameters") or [])]
    if inner:
        assert targeted == list(EXPERT_PARAMS), (stem, targeted)
        return "gate_up_proj"
    if len(targeted) == 2:
        return "down_proj"
    if len(targeted) != 1:
        raise ValueError(f"adapter key {stem}.lora_A.weight: adapter_config.json target_parameters "
                         f"name neither {stem}.gate_up_proj nor {stem}.down_proj")
    return targeted[0]


@dataclass(frozen=True)
class Delta:
    """One adapter pair's low-rank update and the model parameter it adds to.

    `key` is the parameter's state-dict name; `expert` (per-expert layout) the one expert it
    adapts, with `half` ("gate_proj"/"up_proj") the rows of gate_up_proj; a fused PEFT pair
    (`num_experts` set) adapts every expert of a stacked parameter at once.
    """

    stem: str
    key: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    expert: int | None = None
    half: str | None = None
    num_experts: int | None = None

    def value(self, expert: int | None = None) -> torch.Tensor:
        """The fp32 delta; of a fused pair, `expert`'s slice alone (bit for bit that slice of the
        whole bmm: each batch entry is its own matmul)."""
        if self.num_experts is None:
            return self.scaling * (self.b @ self.a)
        a_ErX = self.a.reshape(self.num_experts, -1, self.a.shape[-1])
        b_EOr = self.b.reshape(self.b.shape[0], -1, self.num_experts).permute(2, 0, 1)
        if expert is None:
            return self.scaling * torch.bmm(b_EOr, a_ErX)
        return self.scaling * torch.bmm(b_EOr[expert : expert + 1], a_ErX[expert : expert + 1])[0]

    def add_to(self, weight: torch.Tensor, expert: int | None = None) -> None:
        """Add this delta to `weight`: the whole parameter `key`, or (`expert` given) that
        expert's slab of a stacked one, which only a fused pair or that expert's own pair changes."""
        if expert is None:
            _add_(self.dest(weight), self.value())
        elif self.num_experts is not None:
            _add_(weight, self.value(expert))
        elif self.expert == expert:
            _add_(self.half_of(weight), self.value())

    def dest(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` (the whole parameter) this delta adds to."""
        return self.half_of(param if self.expert is None else param[self.expert])

    def half_of(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` itself, or the gate or up rows of one expert's gate_up_proj slab."""
        if self.half is None:
            return weight
        rows = weight.shape[0] // 2
        return weight[:rows] if self.half == "gate_proj" else weight[rows:]


def _resolve(model: nn.Module, stem: str, config: dict, internal, is_experts, **factors) -> Delta:
    """Where the pair `stem` (an HF name; `internal` gives the module's in-memory name) lands in
    `model` (AttributeError / ValueError when nowhere); `is_experts`: the family's test for its
    stacked routed experts."""
    per_expert, fused = PER_EXPERT_RE.match(stem), FUSED_EXPERTS_RE.match(stem)
    if per_expert:
        experts_name, index, proj = internal(per_expert.group(1)), int(per_expert.group(2)), per_expert.group(3)
        assert is_experts(model.get_submodule(experts_name)), experts_name
        name = "down_proj" if proj == "down_proj" else "gate_up_proj"
        return Delta(stem, f"{experts_name}.{name}", expert=index, half=None if proj == "down_proj" else proj,
                     **factors)
    if fused and is_experts(model.get_submodule(internal(fused.group(1)))):
        key = f"{internal(fused.group(1))}.{fused_expert_proj(fused.group(1), bool(fused.group(2)), config)}"
        return Delta(stem, key, num_experts=model.get_parameter(key).shape[0], **factors)
    linear = model.get_submodule(internal(stem))
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{stem} is a {type(linear).__name__}, not a Linear")
    return Delta(stem, f"{internal(stem)}.weight", **factors)


def adapter_deltas(model: nn.Module, adapter_dir: str | Path) -> list[Delta]:
    """The deltas of an exported adapter (PEFT or per-expert layout) on `model`, in the adapter
    file's order, each checked against the parameter's shape; `model` may be on the meta device
    (the deltas' shapes are worked out there, nothing is computed).

    Raises ValueError for any tensor that does not fit this model (unknown module, wrong shape).
    """
    adapter_dir = Path(adapter_dir)
    config, tensors = read_adapter(adapter_dir)
    rank = int(config["r"])
    scaling = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    if lora_modules(model):
        raise ValueError("merge_adapter_dir needs a plain model; this one already carries LoRA adapters")
    internal, rules = internal_prefix(model), spec_of(model).lora
    assert rules is not None
    deltas = []
    for stem, pair in lora_pairs(adapter_dir, tensors).items():
        try:
            delta = _resolve(model, stem, config, internal, rules.is_grouped_experts, a=pair["A"], b=pair["B"],
                             scaling=scaling)
            dest = delta.dest(model.get_parameter(delta.key))
            meta = replace(delta, a=delta.a.to("meta"), b=delta.b.to("meta"))
            shape = tuple(meta.value().shape)
        except (AttributeError, RuntimeError, ValueError) as exc:  # get_submodule / reshape / matmul
            raise ValueError(f"{adapter_dir}: adapter module {stem} does not fit this model: {exc}") from None
        if shape != tuple(dest.shape):
            raise ValueError(f"{adapter_dir}: adapter module {stem} gives a delta of shape {shape}, "
                             f"the weight has {tuple(dest.shape)}")
        deltas.append(delta)
    return deltas


@torch.no_grad()
def merge_adapter_dir(model: nn.Module, adapter_dir: str | Path) -> int:
    """Add the deltas of an exported adapter (PEFT or per-expert layout) to `model`'s weights.

    Returns the number of (lora_A, lora_B) pairs applied. Raises ValueError for any
    tensor that does not fit this model (unknown module, wrong shape).
    """
    deltas = adapter_deltas(model, adapter_dir)
    for delta in deltas:
        delta.add_to(model.get_parameter(delta.key))
    return len(deltas)


def config_dtype(base_dir: Path) -> torch.dtype:
    config = read_hf_config(base_dir)
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{base_dir}/config.json: dtype {name!r} is not a torch dtype")
    return dtype


def check_base(base_dir: str | Path, adapter_dir: str | Path, force: bool = False) -> str | None:
    """Is BASE_DIR the base the adapter was trained on (the identity in its glmtune_adapter.json)?

    Returns:
        None when the hashes match; otherwise one line for the user: the mismatch that
        `force` lets through, or that the adapter records no base (written by another tool).

    Raises:
        ValueError: the config or weights differ and `force` is False.
    """
    meta_path = Path(adapter_dir) / META_NAME
    recorded = None
    if meta_path.is_file():
        meta = parse_json(meta_path.read_bytes(), str(meta_path), max_bytes=1 << 20)
        recorded = meta.get("base") if isinstance(meta, dict) else []
        if recorded is not None and not (isinstance(recorded, dict) and all(
                isinstance(recorded.get(key, ""), str) for key in ("config_sha256", "weights_sha256"))):
            raise ValueError(f"{meta_path}: not a glmtune adapter record (its base is not an identity of hashes)")
    if not recorded:
        return f"note: ADAPTER_DIR {adapter_dir} records no base ({META_NAME}); the base could not be checked"
    reasons = identity_mismatch(recorded, hf_dir_identity(base_dir))
    if not reasons:
        return None
    problem = f"BASE_DIR {base_dir} is not the base this adapter was trained on ({'; '.join(reasons)})"
    if not force:
        raise ValueError(f"{problem}; pass --force to merge anyway")
    return f"warning: {problem}; merging anyway (--force)"


def merge_to_dir(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                 dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB", *,
                 overwrite: bool = False, force: bool = False, fp8: bool = False) -> Path:
    """Add ADAPTER_DIR's deltas to BASE_DIR's weights, shard by shard, into an HF checkpoint at OUT_DIR.

    The checkpoint is the one `save_pretrained` writes for the base loaded whole, merged
    (`merge_adapter_dir`) and, with `fp8`, re-quantized (`_requantize`), bit for bit, while host
    memory holds about one input shard, one output shard and the adapter
    (`glmtune/peft/merge_stream.py`).

    Args:
        dtype: the merged weights' dtype; None keeps the base checkpoint's (config.json).
        max_shard_size: bytes or a string like "5GB" per output shard file.
        fp8: re-quantize the merged weights of the layers GLM-5's FP8 releases store in e4m3
            into that format (128 x 128 blocks, the spec's `convert_to_fp8_base`) and print
            the re-quantization error; the merge itself is done in fp32 on the dequantized base.
        overwrite: replace a non-empty OUT_DIR (never BASE_DIR or ADAPTER_DIR).
        force: merge even if BASE_DIR is not the base the adapter records (`check_base`).
    """
    base_dir = Path(base_dir)
    sources = (("BASE_DIR", base_dir), ("ADAPTER_DIR", adapter_dir))
    check_output(out_dir, overwrite=overwrite, sources=sources, what="OUT_DIR")  # before hours of work
    read_adapter_config(adapter_dir)  # not an adapter: fail before the base is hashed and loaded
    note = check_base(base_dir, adapter_dir, force)
    if note:
        print(note, file=sys.stderr)
    errors = stream_merge(base_dir, out_dir, dtype or config_dtype(base_dir),
                          lambda model: adapter_deltas(model, adapter_dir), max_shard_size,
                          fp8=fp8, overwrite=overwrite, sources=sources)
    if fp8:
        print(fp8_report(errors))
    return Path(out_dir)


def _requantize(model: nn.Module) -> str:
    """Makes the merged model's quantizable layers FP8; one line with the relative error."""
    errors: list[tuple[float, float]] = []
    spec_of(model).weights.convert_to_fp8_base(model, "dequant", errors=errors)  # GLM-5's fp8_base.py
    return fp8_report(errors)


def fp8_report(errors: list[tuple[float, float]]) -> str:
    """One line from each re-quantized weight's (squared error, squared norm)."""
    overall = math.sqrt(sum(e for e, _ in errors) / max(sum(n for _, n in errors), 1e-300))
    worst = max(math.sqrt(e / n) for e, n in errors if n > 0)
    return (f"re-quantized {len(errors)} merged weights to FP8 (e4m3, 128x128 block scales): relative error "
            f"{overall:.2e} overall, {worst:.2e} in the worst tensor")
