"""The architecture summary of a GLM-5 configuration: the hyper-parameters that shape it, grouped by block.

What `glmtune inspect` prints (and `--json` writes) as `architecture` (its table: `architecture_rows`),
and what preflight's check 3 records as its evidence; computed from `Glm5Args` alone, no model built.
"""

from __future__ import annotations

from typing import Any

from glmtune.models.glm5.args import Glm5Args


def architecture_summary(args: Glm5Args) -> dict[str, Any]:
    """The hyper-parameters that shape the model, grouped by block."""
    full_layers = [i for i, kind in enumerate(args.indexer_types) if kind == "full"]
    return {
        "architecture": "GlmMoeDsaForCausalLM",
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": args.num_hidden_layers,
        "num_dense_layers": args.mlp_layer_types.count("dense"),
        "num_moe_layers": args.mlp_layer_types.count("sparse"),
        "num_mtp_layers": args.num_nextn_predict_layers,
        "hidden_size": args.hidden_size,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention": {
            "num_heads": args.num_attention_heads,
            "q_lora_rank": args.q_lora_rank,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
        },
        "indexer": {
            "num_heads": args.index_n_heads,
            "head_dim": args.index_head_dim,
            "topk": args.index_topk,
            "full_layers": full_layers,
        },
        "moe": {
            "n_routed_experts": args.n_routed_experts,
            "num_experts_per_tok": args.num_experts_per_tok,
            "n_shared_experts": args.n_shared_experts,
            "moe_intermediate_size": args.moe_intermediate_size,
            "n_group": args.n_group,
            "topk_group": args.topk_group,
            "routed_scaling_factor": args.routed_scaling_factor,
        },
        "dense_intermediate_size": args.intermediate_size,
        "rope": {"theta": args.rope_theta, "type": args.rope_parameters.get("rope_type", "default"),
                 "max_position_embeddings": args.max_position_embeddings},
    }


def architecture_rows(arch: dict[str, Any]) -> list[tuple[str, str]]:
    """The architecture table `glmtune inspect` prints, from `architecture_summary`."""
    att, idx, moe, rope = arch["attention"], arch["indexer"], arch["moe"], arch["rope"]
    groups = f", {moe['topk_group']} of {moe['n_group']} groups" if moe["n_group"] > 1 else ""
    return [
        ("layers", f"{arch['num_hidden_layers']} ({arch['num_dense_layers']} dense + "
                   f"{arch['num_moe_layers']} MoE) + {arch['num_mtp_layers']} MTP"),
        ("hidden / vocab", f"{arch['hidden_size']} / {arch['vocab_size']}"
                           + (" (tied embeddings)" if arch["tie_word_embeddings"] else "")),
        ("MLA attention", f"{att['num_heads']} heads, q_lora {att['q_lora_rank']}, "
                          f"kv_lora {att['kv_lora_rank']}, qk {att['qk_nope_head_dim']}+"
                          f"{att['qk_rope_head_dim']}, v {att['v_head_dim']}"),
        ("DSA indexer", f"{idx['num_heads']} heads x {idx['head_dim']}, top-{idx['topk']}; full on "
                        f"{len(idx['full_layers'])}/{arch['num_hidden_layers']} layers"),
        ("MoE", f"{moe['n_routed_experts']} routed (top-{moe['num_experts_per_tok']}{groups}) + "
                f"{moe['n_shared_experts']} shared, width {moe['moe_intermediate_size']}, "
                f"scale {moe['routed_scaling_factor']}"),
        ("dense MLP", f"width {arch['dense_intermediate_size']}"),
        ("RoPE", f"theta {rope['theta']:,.0f} ({rope['type']}), max positions "
                 f"{rope['max_position_embeddings']:,}"),
    ]
