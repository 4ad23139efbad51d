"""Batched incremental decoding (docs/generation.md): the family-agnostic loop (`generate`,
sampling, stops); each family's cache and cached forward sit in its own folder, behind its
spec's `decoding` hooks (GLM-5's: glmtune/models/glm5/decode.py, kv_cache.py)."""

from glmtune.generation.generator import GenerationResult, default_stop_ids, generate, sample_next

__all__ = ["GenerationResult", "default_stop_ids", "generate", "sample_next"]
