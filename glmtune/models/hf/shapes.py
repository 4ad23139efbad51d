"""Parameter and FLOP counts of an `hf` family model from its shapes (`HfArgs`), without torch.

Counted are the matrices: the embedding, attention's q/k/v/o projections, the MLP's gate, up
and down projections (each routed and shared expert's), the router, the LM head unless it is
tied to the embedding. Norm weights and biases are left out: vectors, a few per layer
(tests/models/hf check the count against every matrix of transformers' own model).

Model FLOPs per trained token follow GLM-5's formula (models/glm5/flops.py), so MFU figures of
the two families compare:
    6 x (active matmul parameters: attention projections, dense MLP, top-k + shared experts,
         router, LM head; the input embedding is a lookup, not a matmul)
  + 3 x causal attention within each document (QK^T and PV, forward)
"""

from __future__ import annotations

from glmtune.models.hf.args import HfArgs


def attention_params(args: HfArgs) -> int:
    d, hd = args.hidden_size, args.head_dim
    return d * hd * (2 * args.num_attention_heads + 2 * args.num_key_value_heads)


def dense_mlp_params(args: HfArgs) -> int:
    return 3 * args.hidden_size * args.intermediate_size


def moe_params(args: HfArgs, active: bool) -> int:
    """A MoE layer's experts and router: all of them, or those one token runs through (`active`)."""
    experts = args.num_experts_per_tok if active else args.num_experts
    expert = 3 * args.hidden_size * args.moe_intermediate_size
    return expert * (experts + args.n_shared_experts) + args.hidden_size * args.num_experts


def layer_params(args: HfArgs, layer: int, active: bool = False) -> int:
    mlp = moe_params(args, active) if layer in args.moe_layers else dense_mlp_params(args)
    return attention_params(args) + mlp


def parameter_count(args: HfArgs) -> int:
    """Every matrix of the model (module docstring)."""
    embeddings = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    return embeddings + sum(layer_params(args, i) for i in range(args.num_hidden_layers))


def active_matmul_params(args: HfArgs) -> int:
    """The matmul parameters one token runs through (the LM head included, the embedding not)."""
    layers = sum(layer_params(args, i, active=True) for i in range(args.num_hidden_layers))
    return layers + args.vocab_size * args.hidden_size


def attention_flops_forward(args: HfArgs, doc_lengths: list[int]) -> float:
    """Per token: QK^T and PV over the mean number of keys a query attends (causal, its document)."""
    mean_keys = sum(n * (n + 1) // 2 for n in doc_lengths) / sum(doc_lengths)
    return args.num_hidden_layers * 2 * args.num_attention_heads * mean_keys * 2 * args.head_dim


def flops_per_token(args: HfArgs, doc_lengths: list[int]) -> float:
    return 6 * active_matmul_params(args) + 3 * attention_flops_forward(args, doc_lengths)


def stage_costs(args: HfArgs, seq_len: int) -> tuple[list[float], float]:
    """(training FLOPs of each decoder layer, of the head) for `seq_len` tokens of one document."""
    attention = 3 * 2 * args.num_attention_heads * 2 * args.head_dim * (seq_len + 1) / 2 * seq_len
    layers = [6.0 * layer_params(args, i, active=True) * seq_len + attention for i in range(args.num_hidden_layers)]
    return layers, 6.0 * args.vocab_size * args.hidden_size * seq_len
