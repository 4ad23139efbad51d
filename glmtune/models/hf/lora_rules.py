"""The hf family's `LoraRules` (models/common/lora_rules.py): LoRA on transformers' own models.

A built model is the family's when it is one of transformers' models (GLM-5's native model is
not one). Its module names are the names PEFT gives them on transformers' model, so an adapter
file's names are the module names (`adapter_names`: identity, MoE included).

Default targets (`peft.target_modules: null`): every Linear of the decoder layers (their
attention and MLP: q/k/v/o, gate/up/down, GLM-4's fused gate_up, shared experts) and their
stacked routed experts, one glob per kind (`*.self_attn.q_proj`, `*.mlp.experts`, ...), the
routers aside. The bundled LoRA recipe therefore runs unchanged on a Qwen3 or Llama directory.

Stacked experts: transformers 5 keeps a MoE layer's routed experts as two stacked Parameters,
`gate_up_proj` [E, 2I, D] ([gate; up] rows) and `down_proj` [E, D, I], read by the experts'
own forward (`@use_experts_implementation`: eager loop, grouped_mm, ...). glmtune adapts them as
GLM-5's (one A [E, r, in] and B [E, out, r] per projection, the same export) with the update
folded into the weights that forward reads (`folds_experts`: peft/lora.py `LoRAFoldedExperts`),
which is what PEFT 0.21's `target_parameters` (lora.ParamWrapper) does with them: the export
loads in PEFT with the same outputs. Experts stored otherwise (transposed, [gate, up]
interleaved, with biases, without a gate: GPT-OSS, Llama-4, Granite-MoE-style) are refused by
name (`unadaptable_experts_reason`): glmtune's export of them would not be what PEFT applies.

PEFT rewrites the `target_modules` entries of some MLP leaf names into the fused expert
parameters when it loads an adapter for a MoE architecture transformers converts (its
`_MODEL_TO_CONVERSION_PATTERN`: the qwen2_moe pattern, e.g. qwen3_moe, glm4_moe, deepseek_v3;
the mixtral pattern); `peft_remapped_leaves` names them so the export lists such dense Linears
as parameters, as for GLM-5.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN

from glmtune.models.common.lora_rules import LoraRules

# PEFT 0.21's `_MOE_TARGET_MODULE_MAPPING` keys (peft/utils/transformers_weight_conversion.py),
# per transformers conversion pattern; PEFT maps "mixtral" to its own pattern besides transformers' table.
_PEFT_REMAPPED = {"qwen2_moe": frozenset({"gate_proj", "up_proj", "down_proj", "gate"}),
                  "mixtral": frozenset({"w1", "w2", "w3", "gate"})}
_PEFT_PATTERNS = {**_MODEL_TO_CONVERSION_PATTERN, "mixtral": "mixtral"}
_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.\d+\.(.+)$")
_INDEX_RE = re.compile(r"\.\d+(?=\.|$)")
_EXPERTS = ("gate_up_proj", "down_proj")


def _identity(name: str) -> str:
    return name


def _base_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """`module`'s own Parameters, its LoRA adapters (peft/lora.py's `lora_*`) aside."""
    return {n: p for n, p in module._parameters.items() if p is not None and not n.startswith("lora_")}


def _stacked(module: nn.Module) -> bool:
    """Whether `module` holds 3-D Parameters of its own: a layer's routed experts, stacked."""
    return any(p.dim() == 3 for p in _base_parameters(module).values())


def _layout_problem(module: nn.Module) -> str | None:
    """Why stacked experts are not in the layout glmtune adapts (None: they are)."""
    params = _base_parameters(module)
    if set(params) != set(_EXPERTS):
        return f"Parameters {', '.join(sorted(params))}, not gate_up_proj and down_proj alone"
    for flag, value, what in (("is_transposed", False, "stored transposed"), ("is_concatenated", True,
                              "gate and up rows interleaved"), ("has_bias", False, "with biases"),
                              ("has_gate", True, "without a gate")):
        if getattr(module, flag, value) != value:
            return what
    (num, rows, dim), down = params["gate_up_proj"].shape, tuple(params["down_proj"].shape)
    if rows % 2 or down != (num, dim, rows // 2) or getattr(module, "num_experts", None) != num:
        return f"gate_up_proj {tuple(params['gate_up_proj'].shape)} and down_proj {down} not [E, 2I, D] and [E, D, I]"
    return None


class HfLoraRules(LoraRules):
    folds_experts = True  # transformers' experts run their own forward: the adapters fold into its weights

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, PreTrainedModel)

    def default_targets(self, model: nn.Module) -> tuple[str, ...]:
        globs: dict[str, None] = {}
        for name, module in model.named_modules():  # a LoRA module's factors aside (a model apply_lora adapted)
            match = None if ".lora_" in name else _LAYER_RE.match(name)
            adaptable = isinstance(module, nn.Linear) or self.is_grouped_experts(module)
            if match and adaptable and self.frozen_reason(name, module, False) is None:
                globs["*." + _INDEX_RE.sub(".*", match.group(1))] = None
        if not globs:
            raise ValueError(f"{type(model).__name__} has no Linear layer in its decoder layers (model.layers.N) to "
                             "adapt by default; name the modules in peft.target_modules")
        return tuple(globs)

    def is_grouped_experts(self, module: nn.Module) -> bool:
        return _stacked(module) and _layout_problem(module) is None

    def unadaptable_experts_reason(self, module: nn.Module) -> str | None:
        if not _stacked(module) or self.is_grouped_experts(module):
            return None
        return (f"its stacked experts ({type(module).__name__}: {_layout_problem(module)}) are not in the layout "
                "glmtune's expert adapters cover and PEFT's target_parameters load the same way "
                "(gate_up_proj [E, 2I, D], down_proj [E, D, I])")

    def frozen_reason(self, name: str, module: nn.Module, mtp_trains: bool) -> str | None:
        dotted = f".{name}."
        if dotted.endswith(".mlp.gate.") or ".router." in dotted:  # the spec's "router" group
            return "the router stays frozen (it routes as the base model does)"
        return None

    def adapter_names(self, model: nn.Module) -> tuple[Callable[[str], str], Callable[[str], str]]:
        return _identity, _identity  # transformers' module names are PEFT's

    def peft_remapped_leaves(self, model: nn.Module) -> frozenset[str]:
        pattern = _PEFT_PATTERNS.get(getattr(model.config, "model_type", None))
        return _PEFT_REMAPPED.get(pattern, frozenset())
