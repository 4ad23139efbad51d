"""GLM-5's `LoraRules` (models/common/lora_rules.py): which built model is GLM-5's, its default
targets (`DEFAULT_LORA_TARGETS`), its stacked routed experts (`GroupedExperts`), what stays frozen
(the router: fp32 routing; the DSA indexer: no indexer loss; the MTP layer unless the MTP loss
trains it), the MLP leaves PEFT moves to `target_parameters` for `glm_moe_dsa`, its MLA
`kv_b_proj` (folded into vLLM's attention kernel) and its multi-token-prediction layers."""

from __future__ import annotations

from torch import nn

from glmtune.models.common.lora_rules import LoraRules
from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.model import Glm5ForCausalLM, MTPLayer
from glmtune.models.glm5.moe import GroupedExperts, Router

# NVIDIA's GLM-5.x LoRA recipe targets less kv_b_proj: four MLA projections, the dense MLP
# of the first layers, the shared experts and the grouped routed experts. The DSA indexer
# (`self_attn.indexer.*`) and the router (`mlp.gate`) are deliberately not matched.
# kv_b_proj only when asked (list "*.self_attn.kv_b_proj" in peft.target_modules): vLLM's
# absorbed MLA decode multiplies by W_UK / W_UV taken from the BASE kv_b_proj at load time,
# so a kv_b delta is missing for every key and value a decode query attends (its prefill, dense
# up to 2048 tokens, calls the base kv_b_proj layer: docs/lora.md); measured: logits move by up
# to 0.56 on a trained tiny adapter whose logits span +-2.3 (benchmarks/kv_b_absorbed.py,
# docs/benchmarks.md).
DEFAULT_LORA_TARGETS = (
    "*.self_attn.q_a_proj",
    "*.self_attn.q_b_proj",
    "*.self_attn.kv_a_proj_with_mqa",
    "*.self_attn.o_proj",
    "*.mlp.gate_proj",
    "*.mlp.up_proj",
    "*.mlp.down_proj",
    "*.mlp.shared_experts.*",
    "*.mlp.experts",
)
# PEFT (>= 0.19 with transformers 5) rewrites these target_modules leaves into the fused expert
# parameters for glm_moe_dsa (peft/utils/transformers_weight_conversion.py, the qwen2_moe pattern).
PEFT_REMAPPED_LEAVES = frozenset({"gate_proj", "up_proj", "down_proj", "gate"})


class Glm5LoraRules(LoraRules):
    frozen_kinds = (Router,)

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, Glm5ForCausalLM)

    def default_targets(self, model: nn.Module) -> tuple[str, ...]:
        return DEFAULT_LORA_TARGETS

    def peft_remapped_leaves(self, model: nn.Module) -> frozenset[str]:
        return PEFT_REMAPPED_LEAVES

    def is_grouped_experts(self, module: nn.Module) -> bool:
        return isinstance(module, GroupedExperts)

    def frozen_reason(self, name: str, module: nn.Module, mtp_trains: bool) -> str | None:
        if (name.startswith("mtp.") or name == "mtp") and not mtp_trains:
            return "the MTP layer runs only with the MTP loss (train.mtp_loss_weight > 0)"
        if ".indexer" in f".{name}":
            return "the DSA indexer stays frozen (no indexer loss)"
        if isinstance(module, Router):
            return "the router stays frozen (fp32 routing)"
        return None

    def absorbed_projections(self, model: nn.Module) -> list[nn.Module]:
        return [m.kv_b_proj for m in model.modules() if isinstance(m, MLAttention)]

    def mtp_layers(self, model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
        return [(name, layer, layer.eh_proj) for name, layer in model.named_modules() if isinstance(layer, MTPLayer)]


GLM5_LORA = Glm5LoraRules()
