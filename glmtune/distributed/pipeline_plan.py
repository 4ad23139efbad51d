"""Which decoder layers each pipeline stage runs, and on which pp rank each stage sits (no torch).

Layers are split into consecutive stages balanced by what they cost to train, not by
count: GLM-5's first three layers are dense MLPs (3 x 6144 x 12288 per token), the
other 75 MoE layers (shared expert + 8 of 256 routed experts, 3 x 6144 x 2048 each),
and layers with a full DSA indexer score every earlier key while shared-indexer
layers (GLM-5.2/5.3) do not. The last stage also pays for the final norm and the
154,880-way LM head; the first stage's embedding is a lookup and costs nothing here.

Cost of one training token (FLOPs; forward 1 x, backward 2 x for what trains):

    matmuls     3 x 2 x active weights of the layer (attention projections, MLP or
                shared + top-k routed experts, router)
    attention   3 x 2 x heads x (qk + v dims) x keys, keys = min(i + 1, top-k) for
                query i of a one-document row of `seq_len` tokens (packing only lowers it)
    indexer     2 x index heads x index dim x (i + 1), forward only (frozen)

`balanced_split` minimises the most expensive stage (exact, by dynamic programming).
`parallel.pp_layer_split` overrides it with an explicit split.

Stage placement follows `torch.distributed.pipelining`: a looped schedule puts stages
r, r + pp, r + 2 pp, ... on pp rank r; the V-shaped ones (ZBVZeroBubble, DualPipeV) put
stages r and 2 pp - 1 - r there.
"""

from __future__ import annotations

from functools import lru_cache

from glmtune.models.glm5.args import Glm5Args

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


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


def balanced_split(costs: list[float], num_stages: int, last_extra: float = 0.0) -> list[int]:
    """Layers per stage, consecutive and at least one each, minimising the costliest stage
    (the last stage also pays `last_extra`); ties go to the split with fewer layers late."""
    num_layers = len(costs)
    assert 1 <= num_stages <= num_layers, (num_stages, num_layers)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    @lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        # layers start.. split into `stages` stages: (costliest stage, sizes)
        if stages == 1:
            return prefix[num_layers] - prefix[start] + last_extra, (num_layers - start,)
        options = []
        for size in range(1, num_layers - start - stages + 2):
            rest, sizes = best(start + size, stages - 1)
            options.append((max(prefix[start + size] - prefix[start], rest), tuple(-s for s in sizes), size, sizes))
        worst, _, size, sizes = min(options)
        return worst, (size, *sizes)

    return list(best(0, num_stages)[1])


def plan_stages(args: Glm5Args, num_stages: int, seq_len: int, explicit: list[int] | None = None) -> list[int]:
    """Layers per stage: `explicit` when given (checked by config validation), else balanced by cost."""
    if explicit:
        return list(explicit)
    return balanced_split(layer_costs(args, seq_len), num_stages, head_cost(args))


def stage_ids_for_rank(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages (in order) that pp rank `pp_rank` runs under `schedule`."""
    if schedule in V_SCHEDULES:
        assert stages_per_rank == 2, schedule
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + s * pp for s in range(stages_per_rank)]


def describe_split(layers_per_stage: list[int]) -> str:
    """"20/20/19/19", or "36 stages of 2-3 layers" when long."""
    if len(layers_per_stage) <= 8:
        return "/".join(map(str, layers_per_stage))
    return f"{len(layers_per_stage)} stages of {min(layers_per_stage)}-{max(layers_per_stage)} layers"
