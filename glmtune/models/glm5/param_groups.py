"""Classify GLM-5 parameter names into coarse groups (attention, experts, ...).

The groups are what a user reasons about when choosing what to train or when
reading a parameter inventory:

    attention       MLA projections and their latent norms (q_a_layernorm, kv_a_layernorm)
    indexer         the DSA lightning indexer (self_attn.indexer.*)
    router          mlp.gate.* (weight and the e_score_correction_bias buffer)
    shared_experts  mlp.shared_experts.*
    routed_experts  mlp.experts.* (stacked [E, ...] tensors or per-expert HF keys)
    dense_mlp       mlp.{gate,up,down}_proj of the first_k_dense_replace layers
    norms           input/post_attention layernorms and the final norm
    embeddings      model.embed_tokens
    head            lm_head
    mtp             everything under mtp.{j} (multi-token prediction, frozen by default)

Matching works on dotted path components rather than exact names, so names that
wrappers and adapters produce classify with their base module: PEFT's
`...q_a_proj.lora_A.weight` / `base_model.model.` prefix, stacked expert adapters
(`...mlp.experts.lora_gate_up_A`), torch.compile's `_orig_mod.` and FSDP /
activation-checkpoint wrapper components.
"""

from __future__ import annotations

from torch import nn

GROUPS = (
    "attention",
    "indexer",
    "router",
    "shared_experts",
    "routed_experts",
    "dense_mlp",
    "norms",
    "embeddings",
    "head",
    "mtp",
)

_MLP_CHILDREN = {
    "gate": "router",
    "shared_experts": "shared_experts",
    "experts": "routed_experts",
    "gate_proj": "dense_mlp",
    "up_proj": "dense_mlp",
    "down_proj": "dense_mlp",
}
_LAYER_NORMS = {"input_layernorm", "post_attention_layernorm"}


def _components(name: str) -> list[str]:
    # Wrapper modules insert private components (`_orig_mod`, `_fsdp_wrapped_module`,
    # `_checkpoint_wrapped_module`); they carry no meaning for the group.
    return [part for part in name.split(".") if part and not part.startswith("_")]


def param_group(name: str) -> str:
    """The group (one of `GROUPS`) of a parameter or buffer name.

    Args:
        name: an internal name (`model.layers.3.mlp.experts.gate_up_proj`), optionally
            with adapter suffixes or wrapper prefixes. HF on-disk names classify too,
            except that MTP layers on disk (`model.layers.{L + j}`) cannot be told from
            decoder layers without the config.

    Raises:
        ValueError: the name belongs to no known GLM-5 module.
    """
    parts = _components(name)
    for i, part in enumerate(parts[:-1]):
        if part == "mtp" and parts[i + 1].isdigit():
            return "mtp"
    if "lm_head" in parts:
        return "head"
    if "embed_tokens" in parts:
        return "embeddings"
    if "self_attn" in parts:
        return "indexer" if "indexer" in parts[parts.index("self_attn") :] else "attention"
    if "mlp" in parts:
        # The component right after `mlp` names the sub-module: `gate` (router) is
        # distinct from `gate_proj` (dense MLP), so compare whole components.
        child = parts.index("mlp") + 1
        group = _MLP_CHILDREN.get(parts[child]) if child < len(parts) else None
        if group is not None:
            return group
    elif _LAYER_NORMS.intersection(parts) or ("norm" in parts and "layers" not in parts):
        return "norms"  # per-layer norms, or the final norm (model.norm.weight)
    raise ValueError(f"cannot classify parameter {name!r} into a GLM-5 group ({', '.join(GROUPS)})")


def count_by_group(model: nn.Module, trainable_only: bool = False) -> dict[str, int]:
    """Number of parameter elements per group, every group present (zeros included).

    Tied parameters are counted once (under the first name `named_parameters` gives,
    i.e. the embedding when lm_head is tied to it).

    Args:
        model: a GLM-5 model on any device, meta included.
        trainable_only: count only parameters with `requires_grad`.
    """
    counts = dict.fromkeys(GROUPS, 0)
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        counts[param_group(name)] += param.numel()
    return counts
