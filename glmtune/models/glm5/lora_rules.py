"""GLM-5's `LoraRules` (models/common/lora_rules.py): which built model is GLM-5's, its stacked
routed experts (`GroupedExperts`), what stays frozen (the router: fp32 routing; the DSA indexer:
no indexer loss; the MTP layer unless the MTP loss trains it), its MLA `kv_b_proj` (folded into
vLLM's attention kernel) and its multi-token-prediction layers."""

from __future__ import annotations

from torch import nn

from glmtune.models.common.lora_rules import LoraRules
from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.model import Glm5ForCausalLM, MTPLayer
from glmtune.models.glm5.moe import GroupedExperts, Router


class Glm5LoraRules(LoraRules):
    frozen_kinds = (Router,)

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, Glm5ForCausalLM)

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
