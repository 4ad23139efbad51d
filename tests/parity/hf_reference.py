"""Tiny random transformers `GlmMoeDsaForCausalLM` models: the parity reference.

Each config shrinks widths but keeps every architectural feature: MLA, the DSA
indexer with `index_topk` below the test sequence length (so top-k masking is
real), dense + MoE layers, shared experts, and the chosen indexer/grouping style.
The indexer has 16 heads: with few heads, ReLU often zeroes every head and index
scores tie at exactly 0, and torch.topk may break such ties differently for
different row layouts (a legitimate difference, see the packed-row test).
Norm weights and the router correction bias are randomized so that no term is a
silent identity.
"""

from __future__ import annotations

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
    q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16,
    index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=512, pad_token_id=0,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)

STYLES = {
    # GLM-5 / 5.1: every layer runs its own indexer.
    "glm5": dict(),
    # GLM-5.2 / 5.3: IndexShare, some layers reuse the previous full layer's top-k.
    "glm5.2": dict(index_topk_freq=2, index_skip_topk_offset=2, rope_parameters={"rope_theta": 8e6, "rope_type": "default"}),
    # Group-limited routing with topk_group < n_group.
    "grouped": dict(n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=2),
    # YaRN-scaled RoPE with mscale (changes inverse frequencies, cos/sin and the softmax scale).
    "yarn": dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "beta_fast": 32, "beta_slow": 1}),
}


def make_hf_model(style: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> GlmMoeDsaForCausalLM:
    """A model of `style` (`overrides`: config fields that replace the style's and BASE's)."""
    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(**{**BASE, **STYLES[style], **overrides})
    model = GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.copy_(torch.rand_like(buf) * 0.05)
    model = model.to(dtype)
    if dtype != torch.float32:  # transformers keeps the router in fp32
        for module in model.modules():
            if module.__class__.__name__.endswith("TopkRouter"):
                module.float()
    return model.eval()
