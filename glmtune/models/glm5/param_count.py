"""How many parameters a GLM-5 architecture has, in closed form (no torch).

`glmtune config validate` bounds what a lone config.json may describe (size_bound.py) and must
stay torch-free, so the count is written out here tensor by tensor from the modules'
constructors (model.py, attention.py, indexer.py, moe.py, common/rmsnorm.py), and
tests/models/test_param_count.py holds it equal to the model built on the meta device.
`parameter_report` (counts.py) still counts the built model for `glmtune inspect`.

Each function lists the element counts of the parameters a module creates:

  decoder layer   input and post-attention RMSNorms, MLA attention (q_a_proj, q_a_layernorm,
                  q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; q_a, kv_a and
                  o carry a bias with `attention_bias`), the DSA indexer on a "full" layer (wq_b,
                  wk, k_norm: a LayerNorm with a bias, weights_proj), and a dense MLP or a MoE (the
                  router weight, the stacked routed experts, the shared experts' MLP); the
                  router's `e_score_correction_bias` is a buffer, not a parameter
  MTP layer       a MoE decoder layer with an indexer, plus enorm, hnorm, eh_proj and
                  shared_head.norm
  outside layers  the embedding, the final norm, and the LM head unless tied to the embedding

Every layer of one kind (MLP, indexer) has the same tensors, so a count costs what the number
of kinds does, whatever the depth.
"""

from __future__ import annotations

from collections import Counter

from glmtune.models.glm5.args import Glm5Args


def _linear(in_features: int, out_features: int, bias: bool = False) -> list[int]:
    return [in_features * out_features] + ([out_features] if bias else [])


def attention_tensors(args: Glm5Args, indexer: bool) -> list[int]:
    """MLA's projections and latent norms, and the DSA indexer when the layer has its own."""
    d, n, bias = args.hidden_size, args.num_attention_heads, args.attention_bias
    tensors = (_linear(d, args.q_lora_rank, bias) + [args.q_lora_rank]
               + _linear(args.q_lora_rank, n * args.qk_head_dim)
               + _linear(d, args.kv_lora_rank + args.qk_rope_head_dim, bias) + [args.kv_lora_rank]
               + _linear(args.kv_lora_rank, n * (args.qk_nope_head_dim + args.v_head_dim))
               + _linear(n * args.v_head_dim, d, bias))
    if indexer:
        heads, dim = args.index_n_heads, args.index_head_dim
        tensors += (_linear(args.q_lora_rank, heads * dim) + _linear(d, dim) + [dim, dim]  # k_norm weight, bias
                    + _linear(d, heads))
    return tensors


def mlp_tensors(args: Glm5Args, sparse: bool) -> list[int]:
    """A dense MLP, or a MoE: router weight, stacked routed experts, shared experts."""
    d = args.hidden_size
    if not sparse:
        return 3 * _linear(d, args.intermediate_size)
    experts, width = args.n_routed_experts, args.moe_intermediate_size
    return ([experts * d, experts * 2 * width * d, experts * d * width]
            + 3 * _linear(d, width * args.n_shared_experts))


def layer_tensors(args: Glm5Args, mlp: str, indexer: str) -> list[int]:
    """A decoder layer of MLP kind `mlp` ("dense"/"sparse") and indexer kind `indexer` ("full"/"shared")."""
    norms = [args.hidden_size, args.hidden_size]
    return norms + attention_tensors(args, indexer == "full") + mlp_tensors(args, mlp == "sparse")


def mtp_tensors(args: Glm5Args) -> list[int]:
    """One multi-token-prediction layer: a MoE layer with an indexer, and its glue."""
    d = args.hidden_size
    return layer_tensors(args, "sparse", "full") + [d, d] + _linear(2 * d, d) + [d]  # enorm, hnorm, eh_proj, head norm


def outside_tensors(args: Glm5Args) -> list[int]:
    """The embedding, the final norm and the LM head (none of its own when tied)."""
    embedding = args.vocab_size * args.hidden_size
    return [embedding, args.hidden_size] + ([] if args.tie_word_embeddings else [embedding])


def tensor_groups(args: Glm5Args) -> list[tuple[int, list[int]]]:
    """(how many times, element counts of the tensors) for every kind of part of the model."""
    kinds = Counter(zip(args.mlp_layer_types, args.indexer_types))
    groups = [(count, layer_tensors(args, mlp, indexer)) for (mlp, indexer), count in sorted(kinds.items())]
    return groups + [(args.num_nextn_predict_layers, mtp_tensors(args)), (1, outside_tensors(args))]


def parameter_count(args: Glm5Args) -> int:
    """Parameters of the model `args` describes, MTP layers included (`counts.parameter_report`'s
    total_params_with_mtp)."""
    return sum(count * sum(tensors) for count, tensors in tensor_groups(args))


def largest_tensor(args: Glm5Args) -> int:
    """Elements of the model's largest parameter tensor."""
    return max(max(tensors, default=0) for count, tensors in tensor_groups(args) if count)
