"""What vLLM and SGLang do with each tensor of a glmtune adapter, derived with the engines' own code.

Runs in a venv that has the engines installed (`make test-engines`), never in the default suite.
For every tensor of `adapter_model.safetensors` it records the engine module the tensor lands in,
whether the engine applies it, and with what scale (or why not), for a few serving configurations:

vLLM 0.34 (`GlmMoeDsaForCausalLM` -> `DeepseekV2ForCausalLM` subclass; 2-D MoE LoRA wrapper):
  the engine's `PEFTHelper` (rank limit, scaling), `LoRAModel.from_local_checkpoint` (name parsing
  and the unexpected-module check), `PackedLoRALayerWeights.pack_moe` (per-expert packing) are called
  as they are; the GLM-5 module list and the 3-D-format check (`_validate_moe_lora_format`, which
  needs a built model) are restated from the source.
SGLang 0.5.23: `LoRAConfig`, `get_normalized_target_modules`, `get_target_module_name`, `get_layer_id`
  and `LoRAAdapter.normalize_gate_up_proj` / `normalize_fused_qkv_a_proj` are taken from the installed
  sources; the memory pool's routing (mem_pool.py `load_lora_weight_to_buffer`), the MoE wrapping
  condition (lora_manager.py `update_lora_info`) and shared-expert fusion (deepseek_v2.py
  `shared_experts_fusion_disable_reason`) are restated from the source.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import math
import re
import types
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

VLLM_CONFIGS = {
    "default": dict(max_lora_rank=16, mixed_moe=False, is_3d=False, copy_targets=False),
    # --enable-mixed-moe-lora-format and is_3d_lora_weight=True on the LoRA request
    "mixed_moe_3d": dict(max_lora_rank=16, mixed_moe=True, is_3d=True, copy_targets=False),
    # --lora-target-modules set to the adapter_config's target_modules
    "target_modules_copied": dict(max_lora_rank=16, mixed_moe=False, is_3d=False, copy_targets=True),
}
SGLANG_CONFIGS = {
    "default": dict(lora_target_modules=None, shared_fused=False, strict=False),
    "target_all": dict(lora_target_modules="all", shared_fused=False, strict=False),
    "glm5_shared_fused": dict(lora_target_modules=None, shared_fused=True, strict=False),
}


def version(engine: str) -> str:
    return importlib.metadata.version(engine)


def _tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _hf_config(base_dir: Path) -> dict[str, Any]:
    return json.loads((base_dir / "config.json").read_text())


def _engine_source_function(module: str, qualname: str) -> types.FunctionType:
    """A function exactly as written in an installed engine file, without importing that file."""
    spec_file = Path(importlib.util.find_spec(module.split(".")[0]).submodule_search_locations[0])
    path = spec_file.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    node: Any = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    node.decorator_list = []
    namespace: dict[str, Any] = {"torch": torch, "re": re, "Set": set, "Union": Any, "Iterable": Any,
                                 "List": list, "Dict": dict, "Optional": Any, "Tuple": tuple}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[node.name]


# ---------------------------------------------------------------------------------------- vLLM


def _vllm_modules(cfg: dict[str, Any]) -> dict[str, str]:
    """Module name -> kind for vLLM's GLM-5 model (deepseek_v2.py / deepseek_v32 for CUDA)."""
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for m in ("self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                  "self_attn.indexer.wq_b", "self_attn.indexer.wk_weights_proj"):
            out[p + m] = "linear"
        if i < cfg["first_k_dense_replace"]:
            out[p + "mlp.gate_up_proj"] = out[p + "mlp.down_proj"] = "linear"
        else:
            out[p + "mlp.gate"] = "linear"
            out[p + "mlp.experts"] = "moe2d"  # FusedMoEWithLoRA: is_3d_moe_weight False for DeepseekV2
            out[p + "mlp.shared_experts.gate_up_proj"] = out[p + "mlp.shared_experts.down_proj"] = "linear"
    return out


def vllm_view(adapter_dir: Path, base_dir: Path, *, max_lora_rank: int, mixed_moe: bool, is_3d: bool,
              copy_targets: bool) -> dict:
    import vllm.lora.lora_model
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_in_target_modules, parse_fine_tuned_lora_name

    vllm.lora.lora_model.PIN_MEMORY = False  # no CUDA here; pinning changes no value
    cfg = _hf_config(base_dir)
    modules = _vllm_modules(cfg)
    num_experts = cfg["n_routed_experts"]
    packed = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
              "experts": [f"experts.{e}.{p}" for e in range(num_experts) for p in ("gate_proj", "down_proj", "up_proj")]}
    supported = {m.rsplit(".", 1)[-1] for m in modules}
    expected: list[str] = []
    for m in supported:  # worker_manager._load_adapter
        expected.extend(packed.get(m, [m]))
        if m == "experts":
            expected.append(m)
    tensors = _tensors(adapter_dir)
    names = sorted(tensors)
    unwrapped: set[str] = set()
    if copy_targets:  # LoRAModelManager._create_lora_modules skips modules outside --lora-target-modules
        deploy = json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"]
        unwrapped = {m for m in modules if not is_in_target_modules(m, deploy, packed)}

    def refuse(reason: str) -> dict:
        return {"refusal": reason, "tensors": {n: {"module": None, "applied": False, "reason": reason} for n in names}}

    helper = PEFTHelper.from_local_dir(str(adapter_dir), None)
    try:
        helper.validate_legal(types.SimpleNamespace(max_lora_rank=max_lora_rank))
        lora = LoRAModel.from_local_checkpoint(str(adapter_dir), set(expected), helper, device="cpu",
                                               lora_model_id=1)
    except ValueError as e:
        return refuse(f"ValueError: {str(e)[:300]}")
    # where each tensor's LoRA lands: a module of the model, or a part of a packed module
    target_of: dict[str, str] = {}
    for module, kind in modules.items():
        prefix, leaf = module.rsplit(".", 1)
        for part in packed.get(leaf, []) if len(packed.get(leaf, [])) > 1 else []:
            target_of[f"{prefix}.{part}"] = module
        target_of[module] = module
    out: dict[str, dict] = {}
    refusal = None
    for module, kind in modules.items():
        if kind != "moe2d" or module in unwrapped:
            continue
        outer = lora.loras.get(module)
        if outer is not None and torch.is_tensor(outer.lora_a) and outer.lora_a.dim() == 2 and \
                outer.lora_a.shape[0] == helper.r * num_experts:
            if not (mixed_moe and is_3d):  # model_manager._validate_moe_lora_format
                refusal = ("ValueError: adapter contains fused 3D MoE weights but the model uses a 2D MoE LoRA "
                           "wrapper (--enable-mixed-moe-lora-format and is_3d_lora_weight=True needed)")
            elif lora.loras.get(module + ".base_layer") is None:  # _convert_3d_to_2d_moe_lora returns untouched
                refusal = "set_lora fails: _convert_3d_to_2d_moe_lora needs both gate_up_proj and down_proj"
        subs = [lora.loras.get(f"{module}.{e}.{p}") for e in range(num_experts) for p in ("gate_proj", "down_proj", "up_proj")]
        if any(s is not None for s in subs):
            try:
                PackedLoRALayerWeights.pack_moe(subs, module)
            except AssertionError:
                refusal = f"AssertionError in PackedLoRALayerWeights.pack_moe({module}): an expert projection has no LoRA"
    if refusal:
        return refuse(refusal)
    for name in names:
        module_name, _ = parse_fine_tuned_lora_name(name)
        _, scale = helper.get_rank_and_scaling(module_name)
        if module_name.endswith(".experts.base_layer"):
            target = module_name.removesuffix(".base_layer")
        else:
            target = target_of.get(module_name)
        if target is None:
            out[name] = {"module": None, "applied": False, "reason": f"no vLLM module {module_name}"}
        elif target in unwrapped:
            out[name] = {"module": target, "applied": False, "reason": "module not wrapped: not in --lora-target-modules"}
        else:
            out[name] = {"module": target, "applied": True, "scale": round(scale, 6)}
    return {"refusal": None, "tensors": out}


# -------------------------------------------------------------------------------------- SGLang


def sglang_view(adapter_dir: Path, base_dir: Path, *, lora_target_modules: str | None, shared_fused: bool,
                strict: bool) -> dict:
    normalized = _engine_source_function("sglang.srt.lora.utils", "get_normalized_target_modules")
    target_name = _engine_source_function("sglang.srt.lora.utils", "get_target_module_name")
    gate_up = _engine_source_function("sglang.srt.lora.lora", "LoRAAdapter.normalize_gate_up_proj")
    fused_qkv_a = _engine_source_function("sglang.srt.lora.lora", "LoRAAdapter.normalize_fused_qkv_a_proj")
    cfg = _hf_config(base_dir)
    adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = adapter_cfg["r"], adapter_cfg["lora_alpha"]
    scale = alpha / r  # lora.py: self.scaling = lora_alpha / r, whatever use_rslora says
    if lora_target_modules == "all":  # auto_detect_lora_target_modules on the GLM-5 model
        targets = {"fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj",
                   "embed_tokens", "lm_head"}
    else:
        targets = normalized(adapter_cfg["target_modules"])
    # normalization, per layer, keeping track of which file tensors each normalized weight came from
    tensors = _tensors(adapter_dir)
    sources: dict[str, list[str]] = {n: [n] for n in tensors}
    stub = types.SimpleNamespace(_is_non_gated_moe_weight=lambda name: False)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for n, t in tensors.items():
        layers.setdefault(int(re.search(r"layers\.(\d+)\.", n).group(1)), {})[n] = t
    for weights in layers.values():
        before = {id(t): n for n, t in weights.items()}
        gate_up(stub, list(weights), weights)
        fused_qkv_a(stub, list(weights), weights)
        for new in set(weights) - set(before.values()):
            for key in ("gate_up_proj", "fused_qkv_a_proj_with_mqa"):
                if key in new:
                    old = new.replace("gate_up_proj", "gate_proj") if key == "gate_up_proj" else new.replace(key, "q_a_proj")
                    partner = old.replace("gate_proj", "up_proj") if key == "gate_up_proj" else old.replace("q_a_proj", "kv_a_proj_with_mqa")
                    sources[new] = [s for s in (old, partner) if s in tensors]
    moe_wrapped = "gate_up_proj" in targets and "down_proj" in targets  # lora_manager.update_lora_info
    out: dict[str, dict] = {}
    skipped = []
    for weights in layers.values():
        for name, w in weights.items():
            try:
                target = target_name(name, targets)
            except ValueError:
                skipped.append(name)
                verdict = {"module": None, "applied": False,
                           "reason": "skipped: matches no target module (warning" + (", error in strict mode)" if not strict else ")")}
            else:
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                dense = layer < cfg["first_k_dense_replace"]
                if re.search(r"experts\.(\d+)\.", name) and "shared_experts." not in name:
                    verdict = ({"module": f"layer {layer} {target}_moe", "applied": True, "scale": scale} if moe_wrapped
                               else {"module": None, "applied": False,
                                     "reason": "MoE layer not wrapped: gate_up_proj and down_proj not both target modules"})
                elif ".experts." in name or name.split(".lora_")[0].endswith(".experts"):
                    verdict = {"module": None, "applied": False,
                               "reason": "3-D PEFT expert tensor: no expert index, no 2-D module named experts"}
                elif "shared_experts." in name and shared_fused:
                    verdict = {"module": None, "applied": False,
                               "reason": "shared expert fused into the routed MoE: no shared_experts module"}
                elif not dense and ".mlp." in name and "shared_experts." not in name:
                    verdict = {"module": None, "applied": False, "reason": "no such module in an MoE layer"}
                else:
                    verdict = {"module": f"layer {layer} {target}", "applied": True, "scale": scale}
            for src in sources.get(name, [name]):
                out[src] = verdict
    refusal = None
    if skipped and strict:
        refusal = f"ValueError: {len(skipped)} weight(s) skipped (strict loading)"
    return {"refusal": refusal, "skipped_weights": len(skipped), "tensors": dict(sorted(out.items()))}


def views(engine: str, adapter_dir: Path, base_dir: Path) -> dict[str, dict]:
    if engine == "vllm":
        return {name: vllm_view(adapter_dir, base_dir, **kw) for name, kw in VLLM_CONFIGS.items()}
    return {name: sglang_view(adapter_dir, base_dir, **kw) for name, kw in SGLANG_CONFIGS.items()}


def fixture(engine: str, layout: str, variant: str, adapter_dir: Path, base_dir: Path) -> dict:
    """The JSON fixture for one engine x layout x variant (tests/peft/engine_fixtures/)."""
    adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    out = {"engine": engine, "engine_version": version(engine), "layout": layout, "variant": variant,
           "adapter": {k: adapter_cfg.get(k) for k in ("r", "lora_alpha", "use_rslora", "target_modules",
                                                       "target_parameters")},
           "trained_scale": adapter_cfg["lora_alpha"] / (math.sqrt(adapter_cfg["r"]) if adapter_cfg.get("use_rslora")
                                                         else adapter_cfg["r"]),
           "configs": views(engine, adapter_dir, base_dir)}
    if engine == "vllm":
        from vllm.config.lora import LoRAConfig
        out["max_lora_rank_default"] = LoRAConfig.__dataclass_fields__["max_lora_rank"].default
    return out
