"""Incremental decoding for GLM-5 with a compressed-KV + indexer-key cache (docs/generation.md)."""

from glmtune.generation.kv_cache import DecodeCache, bytes_per_token
from glmtune.generation.generator import GenerationResult, default_stop_ids, generate, sample_next

__all__ = ["DecodeCache", "GenerationResult", "bytes_per_token", "default_stop_ids", "generate", "sample_next"]
