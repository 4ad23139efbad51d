"""glmtune: a PyTorch-native toolkit for fine-tuning the GLM-5 family (GlmMoeDsaForCausalLM)."""

from glmtune.io.version import __version__  # noqa: F401 - glmtune.__version__


def __getattr__(name: str):
    if name in ("load_pretrained", "save_pretrained"):
        # lazily: `import glmtune` (and `glmtune --help`) stay torch-free
        from glmtune.models.glm5 import spec

        return getattr(spec, name)  # GLM-5's: checkpoint/hf_io.py handed GLM-5's HfFormat
    if name in ("build_model", "Glm5Args", "Glm5ForCausalLM", "get_preset"):
        # lazily, torch-free as above
        from glmtune.models import glm5

        return getattr(glm5, name)
    raise AttributeError(name)
