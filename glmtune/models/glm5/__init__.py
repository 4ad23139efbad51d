"""GLM-5 family model (`GlmMoeDsaForCausalLM`): args, modules, HF key adapter.

The model classes import torch; they load on first use, so that what needs only the
architecture's numbers (`glmtune config validate`, the pipeline plan) stays torch-free.
"""

from glmtune.models.glm5.args import Glm5Args, PRESETS, get_preset

__all__ = ["PRESETS", "Glm5Args", "Glm5ForCausalLM", "Glm5Output", "build_model", "get_preset"]


def __getattr__(name: str):
    if name in ("Glm5ForCausalLM", "Glm5Output", "build_model"):
        # lazily: the args alone keep `glmtune config validate` torch-free
        from glmtune.models.glm5 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
