"""glmtune: a PyTorch-native toolkit for fine-tuning the GLM-5 family (GlmMoeDsaForCausalLM)."""

__version__ = "0.1.0"
