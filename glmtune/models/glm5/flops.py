"""Model FLOPs per trained token of a GLM-5, one formula for the trainer and every benchmark.

    6 x (active matmul parameters: MLA projections, dense MLP, top-k + shared experts,
         router, lm_head; the input embedding is a lookup, not a matmul)
  + 3 x causal attention over the keys the DSA indexer selects (QK^T and PV, forward)

The frozen indexer's own matmuls are not counted (no backward); this matches the anchor
figures in ../shared/bench, so MFU numbers are comparable. Padding counts as tokens
(the GPU computes it); a row's padding is one more causal "document".

`cfg` is anything with the HF config's names (`Glm5Args`, transformers' config).
"""

from __future__ import annotations

def active_matmul_params(cfg, layers: int, dense_layers: int) -> int:
    heads, qk, v = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    d = cfg.hidden_size
    mla = (d * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
           + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v) + heads * v * d)
    dense = 3 * d * cfg.intermediate_size
    moe = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + d * cfg.n_routed_experts
    return layers * mla + dense_layers * dense + (layers - dense_layers) * moe + d * cfg.vocab_size


def attended_keys(doc_length: int, topk: int) -> int:
    """Sum over a document's queries of the keys each attends: min(i + 1, top-k), in closed form."""
    if doc_length <= topk:
        return doc_length * (doc_length + 1) // 2
    return topk * (topk + 1) // 2 + (doc_length - topk) * topk


def attention_flops_forward(cfg, layers: int, doc_lengths: list[int]) -> float:
    """Per token: 2 matmuls (QK^T, PV) over the mean number of keys a query attends
    (causal within its document, at most index_topk)."""
    mean_keys = sum(attended_keys(n, cfg.index_topk) for n in doc_lengths) / sum(doc_lengths)
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return layers * 2 * cfg.num_attention_heads * mean_keys * (qk + v)


def flops_per_token(cfg, layers: int, dense_layers: int, doc_lengths: list[int]) -> float:
    return 6 * active_matmul_params(cfg, layers, dense_layers) + 3 * attention_flops_forward(cfg, layers, doc_lengths)
