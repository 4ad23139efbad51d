"""What vLLM and SGLang do with each tensor of a glmtune adapter, derived with the engines' own code.

Runs in a venv that has the engines installed (`make test-engines`), never in the default suite.
For every tensor of `adapter_model.safetensors` it records the engine module the tensor lands in,
whether the engine applies it, and with what scale (or why not), for a few serving configurations:

vLLM 0.34 (`GlmMoeDsaForCausalLM` -> a `DeepseekV2ForCausalLM` subclass: deepseek_v2.py's on CPU,
  `vllm.models.deepseek_v32` `DeepseekV32ForCausalLM` on CUDA; 2-D MoE LoRA wrapper):
  the engine's `PEFTHelper` (rank limit, scaling), `LoRAModel.from_local_checkpoint` (name parsing
  and the unexpected-module check), `PackedLoRALayerWeights.pack_moe` (per-expert packing) are called
  as they are; the GLM-5 module list and the 3-D-format check (`_validate_moe_lora_format`, which
  needs a built model) are restated from the source.
SGLang 0.5.23: `LoRAConfig`, `get_normalized_target_modules`, `get_target_module_name`, `get_layer_id`
  and `LoRAAdapter.normalize_gate_up_proj` / `normalize_fused_qkv_a_proj` are taken from the installed
  sources; the memory pool's routing (mem_pool.py `load_lora_weight_to_buffer`), the MoE wrapping
  condition (lora_manager.py `init_lora_modules`) and shared-expert fusion (deepseek_v2.py
  `shared_experts_fusion_disable_reason`) are restated from the source. What `--lora-target-modules
  all` resolves to is not restated here: it depends on the model SGLang builds (on NVIDIA GPUs it
  takes in the fused DSA indexer's wq_b and the server refuses to start); tests/engines/
  sglang_startup.py runs SGLang's own start-up on GLM-5 for the commands glmtune prints.

The MTP layer (`train.mtp_loss_weight > 0`: adapters under `model.layers.{num_hidden_layers + j}.*`):
  vLLM's `LoRAModel.from_local_checkpoint` runs on the adapter as above (it refuses `eh_proj`, no
  module of the target model); SGLang's `LoRAAdapter` class, taken from the installed lora.py, loads
  every adapter's tensors (`initialize_weights_from_tensors`, as `initialize_weights` does from the
  file; it fails on a layer index >= num_hidden_layers). `mtp_facts` reads, from the installed
  sources, whether the engines' MTP draft models take LoRA and whether speculative decoding applies
  the adapter to the draft; each fact names the file and function it comes from.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import math
import re
import traceback
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
    # --lora-target-modules not given: the adapter_config's target_modules
    "default": dict(extra_target_modules=None, shared_fused=False, strict=False),
    # --lora-target-modules: the adapter_config's names and both expert projections' (glmtune's command for an
    # adapter with routed experts)
    "both_expert_projections": dict(extra_target_modules=("gate_proj", "up_proj", "down_proj"), shared_fused=False,
                                    strict=False),
    "glm5_shared_fused": dict(extra_target_modules=None, shared_fused=True, strict=False),
}


def version(engine: str) -> str:
    return importlib.metadata.version(engine)


def _tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _hf_config(base_dir: Path) -> dict[str, Any]:
    return json.loads((base_dir / "config.json").read_text())


def _engine_file(module: str) -> Path:
    """The installed source file of an engine module (never imported)."""
    root = Path(importlib.util.find_spec(module.split(".")[0]).submodule_search_locations[0])
    return root.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _engine_node(module: str, qualname: str) -> Any:
    """The AST of a class or function (`Class.method` for a method) of an installed engine file."""
    node: Any = ast.parse(_engine_file(module).read_text())
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return node


def _engine_source_function(module: str, qualname: str) -> types.FunctionType:
    """A function exactly as written in an installed engine file, without importing that file."""
    node = _engine_node(module, qualname)
    node.decorator_list = []
    namespace: dict[str, Any] = {"torch": torch, "re": re, "Set": set, "Union": Any, "Iterable": Any,
                                 "List": list, "Dict": dict, "Optional": Any, "Tuple": tuple}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(_engine_file(module)), "exec"), namespace)
    return namespace[node.name]


class _NoImports(ast.NodeTransformer):
    def visit_Import(self, node):  # noqa: N802 (ast API)
        return ast.Pass()

    visit_ImportFrom = visit_Import


def _engine_source_class(module: str, name: str, names: dict[str, Any]) -> type:
    """A class exactly as written in an installed engine file, its methods' local imports replaced by
    `names` (themselves taken from the installed sources): importing SGLang needs CUDA-era packages."""
    import typing

    node = _NoImports().visit(_engine_node(module, name))
    namespace: dict[str, Any] = {"torch": torch, "nn": torch.nn, "re": re, "logger": logging.getLogger(module),
                                 **{t: getattr(typing, t) for t in ("Any", "Dict", "List", "Optional", "Set",
                                                                     "Tuple", "Union", "Iterable")}, **names}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), str(_engine_file(module)),
                 "exec"), namespace)
    return namespace[name]


def _mtp_layer(name: str, cfg: dict[str, Any]) -> int | None:
    """The MTP layer index j of an adapter tensor (HF name `model.layers.{num_hidden_layers + j}.`)."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) - cfg["num_hidden_layers"] if m and int(m.group(1)) >= cfg["num_hidden_layers"] else None


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
        received = re.search(r"but received (\[.*?\])", str(e))
        if received:  # the message's set of expected modules has no stable order: what it refused does
            return refuse("ValueError in LoRAModel.from_local_checkpoint: unexpected target modules "
                          f"{received.group(1)}")
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
            target = target if target in modules else None  # the MTP layer's experts: no such module
        else:
            target = target_of.get(module_name)
        if target is None and _mtp_layer(name, cfg) is not None:
            out[name] = {"module": None, "applied": False,
                         "reason": f"MTP layer: no vLLM module {module_name} in the target model, the only one "
                                   "wrapped with LoRA; the MTP draft model takes none (loaded, unused, no warning)"}
        elif target is None:
            out[name] = {"module": None, "applied": False, "reason": f"no vLLM module {module_name}"}
        elif target in unwrapped:
            out[name] = {"module": target, "applied": False, "reason": "module not wrapped: not in --lora-target-modules"}
        else:
            out[name] = {"module": target, "applied": True, "scale": round(scale, 6)}
    return {"refusal": None, "tensors": out}


# -------------------------------------------------------------------------------------- SGLang


def sglang_load(adapter_dir: Path, base_dir: Path) -> str | None:
    """SGLang's own `LoRAAdapter` (lora.py) reading the adapter's tensors into its CPU layers, as
    `LoRAManager.load_lora_weights` does: None, or the error `_load_lora_adapter` reports (at startup,
    `init_lora_adapters` raises it as `RuntimeError: Failed to load LoRA adapter NAME: ...`)."""
    normalized = _engine_source_function("sglang.srt.lora.utils", "get_normalized_target_modules")
    names = {"get_layer_id": _engine_source_function("sglang.srt.layers.utils.common", "get_layer_id"),
             "get_normalized_target_modules": normalized, "LoRAConfig": Any, "AutoConfig": Any, "LoadConfig": Any,
             "BaseLoRABackend": Any}
    tree = ast.parse(_engine_file("sglang.srt.lora.lora").read_text())
    names["_ROUTED_EXPERT_PATTERN"] = next(eval(ast.unparse(n.value), {"re": re}) for n in tree.body  # noqa: S307
                                           if isinstance(n, ast.Assign) and
                                           ast.unparse(n.targets[0]) == "_ROUTED_EXPERT_PATTERN")
    names["LoRALayer"] = _engine_source_class("sglang.srt.lora.lora", "LoRALayer", names)
    adapter_cls = _engine_source_class("sglang.srt.lora.lora", "LoRAAdapter", names)
    adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    config = types.SimpleNamespace(hf_config=adapter_cfg, r=adapter_cfg["r"], lora_alpha=adapter_cfg["lora_alpha"],
                                   target_modules=adapter_cfg["target_modules"], lora_added_tokens_size=0,
                                   path=str(adapter_dir))
    base_hf_config = types.SimpleNamespace(**_hf_config(base_dir))
    adapter = adapter_cls("adapter", config, base_hf_config, None, None, base_model=None)
    try:  # the file's tensors in its order, names as the loader's safetensors iterator yields them
        adapter.initialize_weights_from_tensors(_tensors(adapter_dir))
    except Exception as e:  # noqa: BLE001 (_load_lora_adapter catches every exception the same way)
        where = [f.name for f in traceback.extract_tb(e.__traceback__)
                 if f.filename == str(_engine_file("sglang.srt.lora.lora"))]
        return f"{type(e).__name__} in LoRAAdapter.{where[-1]}: {e}"
    return None


def sglang_view(adapter_dir: Path, base_dir: Path, *, extra_target_modules: tuple[str, ...] | None,
                shared_fused: bool, strict: bool) -> dict:
    failed = sglang_load(adapter_dir, base_dir)
    if failed:
        reason = f"adapter not loaded: {failed}"
        return {"refusal": reason, "skipped_weights": 0,
                "tensors": {n: {"module": None, "applied": False, "reason": reason}
                            for n in sorted(_tensors(adapter_dir))}}
    normalized = _engine_source_function("sglang.srt.lora.utils", "get_normalized_target_modules")
    target_name = _engine_source_function("sglang.srt.lora.utils", "get_target_module_name")
    gate_up = _engine_source_function("sglang.srt.lora.lora", "LoRAAdapter.normalize_gate_up_proj")
    fused_qkv_a = _engine_source_function("sglang.srt.lora.lora", "LoRAAdapter.normalize_fused_qkv_a_proj")
    cfg = _hf_config(base_dir)
    adapter_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = adapter_cfg["r"], adapter_cfg["lora_alpha"]
    scale = alpha / r  # lora.py: self.scaling = lora_alpha / r, whatever use_rslora says
    # lora_manager.py init_lora_shapes: the --lora-target-modules names, normalized (the adapter's must be among them)
    targets = normalized([*adapter_cfg["target_modules"], *(extra_target_modules or ())])
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
    moe_wrapped = "gate_up_proj" in targets and "down_proj" in targets  # lora_manager.init_lora_modules
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


def sglang_target_module_choices() -> list[str]:
    """The names SGLang's --lora-target-modules accepts besides `all` (its argparse choices, lora.py's
    `lora_target_modules` field: srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES)."""
    tree = ast.parse(_engine_file("sglang.srt.utils.common").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SUPPORTED_LORA_TARGET_MODULES")


# ------------------------------------------------------------------------- the MTP draft model


def _where(module: str, qualname: str) -> str:
    return f"{module.replace('.', '/')}.py {qualname}"


def _bases(module: str, cls: str) -> list[str]:
    return [ast.unparse(b) for b in _engine_node(module, cls).bases]


def _class_attrs(module: str, cls: str) -> list[str]:
    """Names a class body assigns (its own class attributes, not inherited ones)."""
    out = []
    for n in _engine_node(module, cls).body:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        out += [t.id for t in targets if isinstance(t, ast.Name)]
    return out


def _calls(module: str, qualname: str) -> list[str]:
    """The calls a function makes, in source order (`self.speculator.load_model`)."""
    found = [n for n in ast.walk(_engine_node(module, qualname)) if isinstance(n, ast.Call)]
    return [ast.unparse(n.func) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def _mentions(module: str, qualname: str, word: str) -> bool:
    """Whether a function's code (comments and docstrings aside) names `word` (any case)."""
    node = _engine_node(module, qualname)
    code = [n for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute, ast.alias, ast.arg))]
    return any(word.lower() in (getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None)
                                or getattr(n, "arg", "")).lower() for n in code)


def _draft_model(module: str, cls: str) -> dict:
    bases = _bases(module, cls)
    return {"source": _where(module, cls), "bases": bases, "supports_lora": "SupportsLoRA" in bases,
            "packed_modules_mapping": "packed_modules_mapping" in _class_attrs(module, cls)}


def _vllm_mtp_facts() -> dict:
    tree = ast.parse(_engine_file("vllm.model_executor.models.registry").read_text())
    spec_models = next(n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                       "_SPECULATIVE_DECODING_MODELS" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign)
                                                                         else n.target))
    entry = next(v for k, v in zip(spec_models.keys, spec_models.values)
                 if ast.literal_eval(k) == "DeepseekV32MTPModel")
    speculative = _engine_node("vllm.config.speculative", "SpeculativeConfig.hf_config_override")
    v32 = next(ast.unparse(n.value) for n in ast.walk(speculative) if isinstance(n, ast.Assign) and
               ast.unparse(n.targets[0]) == "use_v32_mtp")
    platforms = next(n for n in ast.parse(_engine_file("vllm.models.deepseek_v32.__init__").read_text()).body
                     if isinstance(n, ast.If))  # if current_platform.is_cuda(): ...
    on_cuda = next(ast.unparse(n) for n in platforms.body if isinstance(n, ast.ImportFrom) and
                   any(a.asname == "GlmMoeDsaForCausalLM" for a in n.names))
    runner = [c for c in _calls("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model")
              if "lora" in c or "speculator" in c]
    return {
        "target_model": {
            "source": _where("vllm.models.deepseek_v32.nvidia.model", "DeepseekV32ForCausalLM") + "; "
                      "vllm/models/deepseek_v32/__init__.py (the CUDA branch)",
            "GlmMoeDsaForCausalLM_on_cuda": on_cuda,
            "bases": _bases("vllm.models.deepseek_v32.nvidia.model", "DeepseekV32ForCausalLM"),
            "DeepseekV2ForCausalLM_bases": _bases("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),
            "lora_skip_prefixes_defined": "lora_skip_prefixes" in _class_attrs(
                "vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM"),
        },
        "draft_architecture": {"source": "vllm/config/speculative.py SpeculativeConfig.hf_config_override; "
                                         "vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS",
                               "use_v32_mtp": v32, "DeepseekV32MTPModel": ast.literal_eval(entry)},
        "draft_models": {
            "DeepseekV32MTP (CUDA)": _draft_model("vllm.models.deepseek_v32.nvidia.mtp", "DeepseekV32MTP"),
            "DeepseekV32MTP (ROCm)": _draft_model("vllm.models.deepseek_v32.amd.mtp", "DeepseekV32MTP"),
            "DeepSeekMTP (CPU, XPU)": _draft_model("vllm.model_executor.models.deepseek_mtp", "DeepSeekMTP"),
            "Glm4MoeMTP (GLM-4.5, for comparison)": _draft_model("vllm.model_executor.models.glm4_moe_mtp",
                                                                 "Glm4MoeMTP"),
        },
        "lora_in_speculative_decoding": {
            "source": "vllm/v1/worker/gpu/model_runner.py GPUModelRunner.load_model; "
                      "vllm/v1/worker/gpu/spec_decode/eagle/utils.py load_eagle_model, maybe_share_target_embed",
            "load_model_calls": runner,  # the LoRA manager wraps self.model (the target) before the draft loads
            "load_eagle_model_uses_lora": _mentions("vllm.v1.worker.gpu.spec_decode.eagle.utils", "load_eagle_model",
                                                    "lora"),
            "shared_embedding_unwraps_lora": _mentions("vllm.v1.worker.gpu.spec_decode.eagle.utils",
                                                       "maybe_share_target_embed", "BaseLayerWithLoRA"),
        },
    }


def _sglang_mtp_facts() -> dict:
    cond = next(ast.unparse(n.test) for n in ast.walk(_engine_node("sglang.srt.model_executor.model_runner",
                                                                   "ModelRunner.maybe_init_lora_manager"))
                if isinstance(n, ast.If) and "init_lora_manager" in ast.unparse(n.body))
    algos = next(ast.literal_eval(n.value) for n in ast.walk(_engine_node("sglang.srt.arg_groups.lora_hook",
                                                                          "check_lora_speculative_compatibility"))
                 if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "lora_spec_algorithms")
    layers = next(ast.unparse(n.args[0]) for n in ast.walk(_engine_node("sglang.srt.lora.lora", "LoRAAdapter.__init__"))
                  if isinstance(n, ast.Call) and ast.unparse(n.func) == "range")
    draft = _engine_node("sglang.srt.configs.model_config", "ModelConfig._config_draft_model")
    rename = next(ast.unparse(n) for n in ast.walk(draft) if isinstance(n, ast.If) and
                  "GlmMoeDsaForCausalLMNextN" in ast.unparse(n.body) and "GlmMoeDsaForCausalLM'" in ast.unparse(n.test))
    return {
        "draft_architecture": {"source": _where("sglang.srt.configs.model_config", "ModelConfig._config_draft_model"),
                               "rule": rename.replace("\n", " ").replace("    ", " ")},
        "draft_models": {
            "GlmMoeDsaForCausalLMNextN": {"source": _where("sglang.srt.models.glm4_moe", "GlmMoeDsaForCausalLMNextN"),
                                          "bases": _bases("sglang.srt.models.glm4_moe", "GlmMoeDsaForCausalLMNextN")},
            "DeepseekV3ForCausalLMNextN": {"source": _where("sglang.srt.models.deepseek_nextn",
                                                            "DeepseekV3ForCausalLMNextN"),
                                           "bases": _bases("sglang.srt.models.deepseek_nextn",
                                                           "DeepseekV3ForCausalLMNextN")},
        },
        "lora_in_speculative_decoding": {
            "source": _where("sglang.srt.model_executor.model_runner", "ModelRunner.maybe_init_lora_manager") + "; " +
                      _where("sglang.srt.arg_groups.lora_hook", "check_lora_speculative_compatibility"),
            "lora_manager_created_if": cond,
            "speculative_algorithms_with_lora": list(algos),
        },
        "adapter_layers": {"source": _where("sglang.srt.lora.lora", "LoRAAdapter.__init__"), "count": layers},
        "failed_load_at_startup": {"source": _where("sglang.srt.lora.lora_manager", "LoRAManager.init_lora_adapters"),
                                   "raises": [c for c in _calls("sglang.srt.lora.lora_manager",
                                                                "LoRAManager.init_lora_adapters") if "Error" in c]},
    }


def mtp_facts(engine: str) -> dict:
    """What the engine's code does with an MTP draft model under LoRA, read from its installed sources."""
    return _vllm_mtp_facts() if engine == "vllm" else _sglang_mtp_facts()


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
    if any(_mtp_layer(n, _hf_config(base_dir)) is not None for n in _tensors(adapter_dir)):
        out["mtp"] = mtp_facts(engine)
    if engine == "vllm":
        from vllm.config.lora import LoRAConfig
        out["max_lora_rank_default"] = LoRAConfig.__dataclass_fields__["max_lora_rank"].default
    return out
