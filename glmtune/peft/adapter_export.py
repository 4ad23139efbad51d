"""LoRA adapters out, in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

Two layouts of the same adapter, both with HF module names under the
`base_model.model.` prefix (module names equal transformers' in-memory names):
* `peft` (RUN_DIR/adapter/): what `peft.PeftModel.from_pretrained` loads onto
  transformers' `GlmMoeDsaForCausalLM`, whose experts are stacked 3-D Parameters.
  Routed experts use PEFT's `target_parameters` (lora.ParamWrapper) layout:
      ...mlp.experts.base_layer.lora_A.weight  [E*r, D]    gate_up_proj (inner wrapper)
      ...mlp.experts.base_layer.lora_B.weight  [2I, r*E]
      ...mlp.experts.lora_A.weight             [E*r, I]    down_proj (outer wrapper)
      ...mlp.experts.lora_B.weight             [D, r*E]
  (A rows are expert-major, B columns rank-major: B[:, k*E + e]; with one projection
  targeted its wrapper is the only one and drops `base_layer`.) Dense and shared-expert
  MLP projections are listed under `target_parameters` as `<module>.weight` too: PEFT
  rewrites any `target_modules` entry ending in gate_proj/up_proj/down_proj into the
  fused expert parameters for this architecture (peft/utils/transformers_weight_
  conversion.py), which would drop them. Their tensor keys are unchanged. Which leaves
  PEFT rewrites is the family's (`LoraRules.peft_remapped_leaves`: for an hf model, those of
  the MoE architectures transformers converts; none for a dense one).
* `per_expert` (RUN_DIR/adapter_per_expert/): what vLLM and SGLang load for GLM-5
  (see docs/lora.md): one pair per expert and projection,
      ...mlp.experts.{e}.gate_proj.lora_A.weight [r, D]  lora_B [I, r]
      ...mlp.experts.{e}.up_proj.lora_A.weight   [r, D]  lora_B [I, r]   (same A as gate_proj)
      ...mlp.experts.{e}.down_proj.lora_A.weight [r, I]  lora_B [D, r]

Both are exact: nothing is approximated or dropped. Anything trainable that a LoRA
adapter cannot carry (an unfrozen norm, say) makes the export raise.

An MTP layer's adapters (a run with the MTP loss; `apply.py`) are written under the HF
names the state-dict adapter gives that layer (`mtp.{j}.*` -> `model.layers.{L + j}.*`),
in both layouts. transformers' GlmMoeDsaForCausalLM has no such layer in memory, so PEFT
leaves those keys unloaded; merging (`merge.py`) folds them into the MTP layer's weights.

Given the base's identity (`glmtune.checkpoint.fingerprint`), an export also writes
`glmtune_adapter.json` ({"base": identity, "glmtune_version", "layout"}) beside the
PEFT files, for `glmtune merge` to check its BASE_DIR against; PEFT never reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from glmtune.distributed.pipeline_state import merge_on_rank0, model_order
from glmtune.io.outputs import Source, output_dir
from glmtune.io.version import __version__
from glmtune.peft.family import hf_prefix, spec_of
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear, LoraSpec, lora_modules

LAYOUTS = ("peft", "per_expert")
RUN_DIRS = {"peft": "adapter", "per_expert": "adapter_per_expert"}
PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
META_NAME = "glmtune_adapter.json"  # glmtune's own record: the base's identity (not a PEFT file)
_LAYER_RE = re.compile(r"^model\.layers\.\d+\.(.+)$")


def check_exportable(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAGroupedExperts]]:
    """The LoRA modules, after checking that they are all an adapter file needs to carry.

    Raises:
        ValueError: no adapters, or a trainable parameter that is not a LoRA factor.
    """
    adapted = lora_modules(model)
    if not adapted:
        raise ValueError("the model has no LoRA adapters to export (peft.method: none trains full weights; "
                         "export those with save_pretrained)")
    factors = {f"{name}.{pname}" for name, module in adapted
               for pname, _ in module.named_parameters() if "lora_" in pname}
    for name, param in model.named_parameters():
        if param.requires_grad and name not in factors:
            raise ValueError(f"parameter {name} is trainable but a LoRA adapter cannot represent it; "
                             "refusing to export an adapter that silently drops it")
    for name, _ in adapted:
        assert ".indexer." not in name, name
    spec = adapted[0][1].spec
    assert all(module.spec == spec for _, module in adapted), "one LoRA spec per model"
    return adapted


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP2 shards parameters as DTensors: gather (a collective, so every rank exports).
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _peft_expert_tensors(name: str, module: LoRAGroupedExperts) -> dict[str, torch.Tensor]:
    out = {}
    nested = len(module.targets) == 2
    for proj in module.targets:
        a_ErX, b_EOr = map(_full, module.adapter(proj))
        num_experts, rank, in_dim = a_ErX.shape
        # PEFT nests one ParamWrapper per targeted parameter, in registration order:
        # gate_up_proj is wrapped first and becomes the inner `base_layer`.
        stem = f"{name}.base_layer" if nested and proj == "gate_up_proj" else name
        out[f"{stem}.lora_A.weight"] = a_ErX.reshape(num_experts * rank, in_dim)
        out[f"{stem}.lora_B.weight"] = b_EOr.permute(1, 2, 0).reshape(b_EOr.shape[1], rank * num_experts)
    return out


def _per_expert_tensors(name: str, module: LoRAGroupedExperts) -> dict[str, torch.Tensor]:
    out = {}
    for proj in module.targets:
        a_ErX, b_EOr = map(_full, module.adapter(proj))
        half = b_EOr.shape[1] // 2
        for e in range(a_ErX.shape[0]):
            if proj == "down_proj":
                out[f"{name}.{e}.down_proj.lora_A.weight"] = a_ErX[e]
                out[f"{name}.{e}.down_proj.lora_B.weight"] = b_EOr[e]
            else:  # one shared A for the fused [gate; up] rows: written for both
                out[f"{name}.{e}.gate_proj.lora_A.weight"] = a_ErX[e]
                out[f"{name}.{e}.gate_proj.lora_B.weight"] = b_EOr[e, :half]
                out[f"{name}.{e}.up_proj.lora_A.weight"] = a_ErX[e]
                out[f"{name}.{e}.up_proj.lora_B.weight"] = b_EOr[e, half:]
    return out


def peft_match(name: str, entries: list[str]) -> bool:
    """PEFT's list matching: an entry selects a name equal to it or ending in `.entry`."""
    return any(name == entry or name.endswith(f".{entry}") for entry in entries)


def compress_targets(chosen: list[str], universe: list[str]) -> list[str]:
    """The fewest PEFT list entries that select exactly `chosen` among `universe`.

    A layer-independent suffix (`self_attn.q_a_proj`) when every layer's module of that
    kind is chosen, the full names otherwise (e.g. after `peft.exclude_modules`).
    """
    def suffix(name: str) -> str:
        match = _LAYER_RE.match(name)
        return match.group(1) if match else name

    chosen_set, entries = set(chosen), []
    for kind in dict.fromkeys(suffix(n) for n in chosen):
        same_kind = {u for u in universe if suffix(u) == kind}
        if same_kind <= chosen_set:
            entries.append(kind)
        else:
            entries.extend(n for n in chosen if suffix(n) == kind)
    selected = {u for u in universe if peft_match(u, entries)}
    assert selected == chosen_set, sorted(selected ^ chosen_set)[:5]
    return entries


def _config(spec: LoraSpec, target_modules: list[str], target_parameters: list[str] | None,
            dropout: float, base_model_name_or_path: str | None) -> dict[str, Any]:
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": spec.rslora,
        "target_modules": target_modules, "target_parameters": target_parameters, "exclude_modules": None,
        "bias": "none", "lora_bias": False, "use_dora": False, "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def adapter_state(model: nn.Module, layout: str = "peft", base_model_name_or_path: str | None = None,
                  pp_group=None) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(adapter_config dict, tensors keyed as on disk) for `layout` ("peft" or "per_expert").

    Under pipeline parallelism (`pp_group`) each rank holds its stages' adapters: the
    pieces are merged on global rank 0, which alone gets the result (None elsewhere)."""
    if layout not in LAYOUTS:
        raise ValueError(f"adapter layout {layout!r} unknown; choose from {', '.join(LAYOUTS)}")
    adapted = check_exportable(model)
    spec = adapted[0][1].spec
    to_hf = hf_prefix(model)  # the family's adapter names: an MTP layer's modules get its on-disk names
    # Leaf names PEFT remaps from target_modules to the fused expert parameters for this
    # architecture: such Linears must be targeted as parameters.
    remapped = spec_of(model).lora.peft_remapped_leaves(model)
    tensors: dict[str, torch.Tensor] = {}
    modules, parameters = [], []
    for internal_name, module in adapted:
        name = to_hf(internal_name)
        if isinstance(module, LoRALinear):
            tensors[f"{name}.lora_A.weight"] = _full(module.lora_A.weight)
            tensors[f"{name}.lora_B.weight"] = _full(module.lora_B.weight)
            if layout == "peft" and name.rpartition(".")[2] in remapped:
                parameters.append(f"{name}.weight")
            else:
                modules.append(name)
        elif layout == "peft":
            tensors.update(_peft_expert_tensors(name, module))
            parameters.extend(f"{name}.{proj}" for proj in module.targets)
        else:
            tensors.update(_per_expert_tensors(name, module))
            leaves = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
            modules.extend(f"{name}.{leaf}" for proj in module.targets for leaf in leaves[proj])
    # The names the target lists must select exactly among; the MTP layer's only when it is adapted,
    # so an adapter without it keeps the lists of a model without it.
    with_mtp = any(n.startswith("mtp.") for n, _ in adapted)
    hf_modules = [to_hf(n) for n, _ in model.named_modules()
                  if n and (not n.startswith("mtp") or with_mtp and to_hf(n) != n)]
    hf_params = [to_hf(n) for n, _ in model.named_parameters()
                 if (not n.startswith("mtp.") or with_mtp) and ".lora_" not in n]
    tensors = {PREFIX + k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
    if pp_group is not None:
        parts = merge_on_rank0({"tensors": tensors, "modules": modules, "parameters": parameters,
                                "hf_modules": hf_modules, "hf_params": hf_params}, pp_group, merge=_merge_parts)
        if parts is None:
            return None
        tensors, modules, parameters = parts["tensors"], parts["modules"], parts["parameters"]
        hf_modules, hf_params = parts["hf_modules"], parts["hf_params"]
    if layout == "peft":
        # PEFT ParamWrapper refuses lora_dropout != 0; dropout is a training-time op only.
        config = _config(spec, compress_targets(modules, hf_modules),
                         compress_targets(parameters, hf_params) or None, 0.0, base_model_name_or_path)
    else:
        # Engines read the leaf names (vLLM: safetensors keys are the source of truth;
        # SGLang: name.split(".")[-1]); per-expert names are not modules of our model.
        leaves = sorted({m.rpartition(".")[2] for m in modules})
        config = _config(spec, leaves, None, spec.dropout, base_model_name_or_path)
        config.pop("target_parameters")
    return config, tensors


def _merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One pipeline rank's adapter pieces per entry of `parts`, joined in model order."""
    def ordered(names):
        return sorted(names, key=lambda n: model_order(n.removeprefix(PREFIX)))

    tensors = {k: v for part in parts for k, v in part["tensors"].items()}
    merged = {"tensors": {k: tensors[k] for k in ordered(tensors)}}
    for key in ("modules", "parameters", "hf_modules", "hf_params"):
        merged[key] = ordered(dict.fromkeys(n for part in parts for n in part[key]))
    return merged


def export_adapter(model: nn.Module, out_dir: str | Path, layout: str = "peft",
                   base_model_name_or_path: str | None = None, *, overwrite: bool = False,
                   sources: tuple[Source, ...] = (), base_identity: dict[str, Any] | None = None,
                   pp_group=None) -> Path:
    """Write `out_dir/{adapter_config.json, adapter_model.safetensors}` atomically.

    Args:
        model: the model `apply_lora` transformed (and trained).
        out_dir: destination directory (`glmtune.io.outputs.output_dir` rules).
        layout: "peft" (PeftModel.from_pretrained on transformers) or "per_expert"
            (vLLM / SGLang).
        base_model_name_or_path: recorded in adapter_config.json.
        overwrite: replace a non-empty `out_dir`.
        sources: (label, path) of inputs `out_dir` must not be, be inside or contain.
        base_identity: the base's identity (`glmtune.checkpoint.fingerprint`), recorded in
            glmtune_adapter.json for `glmtune merge` to check.

    Under FSDP2 call it on every rank (the adapters are gathered); rank 0 writes. Under
    pipeline parallelism pass the pp group: every stage's adapters reach rank 0.
    """
    state = adapter_state(model, layout, base_model_name_or_path, pp_group)
    out_dir = Path(out_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return out_dir  # every rank gathers the shards above; rank 0 writes
    config, tensors = state
    with output_dir(out_dir, overwrite=overwrite, sources=sources, what="--adapter") as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if base_identity is not None:
            meta = {"base": base_identity, "glmtune_version": __version__, "layout": layout}
            (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def export_run_adapters(model: nn.Module, run_dir: str | Path, base_model_name_or_path: str | None = None,
                        base_identity: dict[str, Any] | None = None, pp_group=None) -> dict[str, Path]:
    """Both layouts into RUN_DIR/adapter (PEFT) and RUN_DIR/adapter_per_expert (engines).

    These are the run's own outputs: a resumed run replaces its earlier export.
    """
    return {layout: export_adapter(model, Path(run_dir) / sub, layout, base_model_name_or_path,
                                   overwrite=True, base_identity=base_identity, pp_group=pp_group)
            for layout, sub in RUN_DIRS.items()}
