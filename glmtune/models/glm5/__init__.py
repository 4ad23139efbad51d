"""GLM-5 family model (`GlmMoeDsaForCausalLM`): args, modules, HF key adapter."""

from glmtune.models.glm5.args import PRESETS, Glm5Args, get_preset, resolve_args
from glmtune.models.glm5.model import Glm5ForCausalLM, Glm5Output, build_model

__all__ = ["PRESETS", "Glm5Args", "Glm5ForCausalLM", "Glm5Output", "build_model", "get_preset", "resolve_args"]
