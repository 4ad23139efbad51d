"""GLM-5's training cost per decoder layer and of the LM head, for the pipeline split (no torch).

The pipeline split (`glmtune/distributed/pipeline_plan.py`) balances stages by what their
layers cost to train, not by count; these are GLM-5's costs. Its first three layers are
dense MLPs (3 x 6144 x 12288 per token), the other 75 MoE layers (shared expert + 8 of
256 routed experts, 3 x 6144 x 2048 each), and layers with a full DSA indexer score
every earlier key while shared-indexer layers (GLM-5.2/5.3) do not. The last stage also
pays for the final norm and the 154,880-way LM head (`head_cost`); the first stage's
embedding is a lookup and costs nothing here.

Cost of one training token (FLOPs; forward 1 x, backward 2 x for what trains):

    matmuls     3 x 2 x active weights of the layer (attention projections, MLP or
                shared + top-k routed experts, router)
    attention   3 x 2 x heads x (qk + v dims) x keys, keys = min(i + 1, top-k) for
                query i of a one-document row of `seq_len` tokens (packing only lowers it)
    indexer     2 x index heads x index dim x (i + 1), forward only (frozen)
"""

from __future__ import annotations

from glmtune.models.glm5.args import Glm5Args


def _mean_keys(seq_len: int, cap: int | None) -> float:
    """Mean over queries 0..seq_len-1 of min(i + 1, cap) (cap None: no cap)."""
    if cap is None or cap >= seq_len:
        return (seq_len + 1) / 2
    # queries 0..cap-1 see i + 1 keys, the rest see cap
    return (cap * (cap + 1) / 2 + (seq_len - cap) * cap) / seq_len


def layer_costs(args: Glm5Args, seq_len: int) -> list[float]:
    """Training FLOPs per token of each decoder layer (module docstring)."""
    d, n = args.hidden_size, args.num_attention_heads
    attention_weights = (d * args.q_lora_rank + args.q_lora_rank * n * args.qk_head_dim
                         + d * (args.kv_lora_rank + args.qk_rope_head_dim)
                         + args.kv_lora_rank * n * (args.qk_nope_head_dim + args.v_head_dim)
                         + n * args.v_head_dim * d)
    attention = 3 * 2 * n * (args.qk_head_dim + args.v_head_dim) * _mean_keys(seq_len, args.index_topk)
    indexer_weights = args.q_lora_rank * args.index_n_heads * args.index_head_dim + d * args.index_head_dim \
        + d * args.index_n_heads
    indexer = 2 * indexer_weights + 2 * args.index_n_heads * args.index_head_dim * _mean_keys(seq_len, None)
    dense_mlp = 3 * d * args.intermediate_size
    expert = 3 * d * args.moe_intermediate_size
    moe = expert * (args.n_shared_experts + args.num_experts_per_tok) + args.n_routed_experts * d
    costs = []
    for mlp, index in zip(args.mlp_layer_types, args.indexer_types):
        active = attention_weights + (moe if mlp == "sparse" else dense_mlp)
        costs.append(3 * 2 * active + attention + (indexer if index == "full" else 0.0))
    return costs


def head_cost(args: Glm5Args) -> float:
    """Training FLOPs per token of the LM head (the last stage's extra work)."""
    return 3 * 2 * args.vocab_size * args.hidden_size
