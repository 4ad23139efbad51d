"""GLM-5's `LoraRules` (models/common/lora_rules.py): which built model is GLM-5's, its MLA
`kv_b_proj` (folded into vLLM's attention kernel) and its multi-token-prediction layers."""

from __future__ import annotations

from torch import nn

from glmtune.models.common.lora_rules import LoraRules
from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.model import Glm5ForCausalLM, MTPLayer


class Glm5LoraRules(LoraRules):
    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, Glm5ForCausalLM)

    def absorbed_projections(self, model: nn.Module) -> list[nn.Module]:
        return [m.kv_b_proj for m in model.modules() if isinstance(m, MLAttention)]

    def mtp_layers(self, model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
        return [(name, layer, layer.eh_proj) for name, layer in model.named_modules() if isinstance(layer, MTPLayer)]


GLM5_LORA = Glm5LoraRules()
