"""Parameter counts of a GLM-5 configuration, computed on the meta device.

The model is built with `build_model(args, device="meta")`, so the counts are those
of the real module tree (not a formula that can drift from it) and no memory is
allocated even for the 754B configurations.

Conventions (they match the architecture doc §7 and `docs/params.py`):
  * "total" excludes the MTP layers; "total_with_mtp" includes them.
  * "active" is per token in the main forward pass: every non-expert parameter
    (attention, indexer, norms, dense MLP, embedding, lm_head), the router, the
    shared experts, and `num_experts_per_tok / n_routed_experts` of each layer's
    routed experts. MTP layers are not active.
  * The headline active count excludes the input embedding (a lookup, not a
    matmul); the lm_head is kept. With tied embeddings the shared matrix is the
    head, so nothing is excluded from the headline.
  * `e_score_correction_bias` is a buffer, not a parameter, and is reported apart.

For GLM-5: total 743,911,199,232, with MTP 753,864,119,552, active 40.83B.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.moe import MoE
from glmtune.models.glm5.param_groups import GROUPS, count_by_group, param_group

_BIAS_BUFFER = "e_score_correction_bias"


def _routed_active(mlp: nn.Module, top_k: int) -> tuple[int, int]:
    """(all, active) routed-expert elements of one layer's MLP; (0, 0) for a dense MLP."""
    if not isinstance(mlp, MoE):
        return 0, 0
    num_routed = sum(p.numel() for p in mlp.experts.parameters())
    # Experts are stacked on dim 0, so the per-expert size divides exactly.
    return num_routed, num_routed // mlp.num_experts * top_k


def _layer_row(index: int, layer: nn.Module, top_k: int, mtp: bool) -> dict[str, Any]:
    num_params = sum(p.numel() for p in layer.parameters())
    num_routed, num_routed_active = _routed_active(layer.mlp, top_k)
    return {
        "index": index,  # HF numbering: MTP layers follow the decoder layers
        "mlp": "moe" if isinstance(layer.mlp, MoE) else "dense",
        "indexer": "full" if layer.self_attn.indexer is not None else "shared",
        "mtp": mtp,
        "params": num_params,
        # Per token whenever the layer runs (MTP layers do not run in the main forward).
        "active_params": num_params - num_routed + num_routed_active,
    }


def layer_label(row: dict[str, Any]) -> str:
    """"MoE, full" / "dense, shared" / "MoE, full (MTP)" for a layer or run row."""
    kind = f"{'MoE' if row['mlp'] == 'moe' else 'dense'}, {row['indexer']}"
    return f"{kind} (MTP)" if row["mtp"] else kind


def layer_runs(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive layers of the same kind and size merged into one row.

    Each run: first, last, count, mlp, indexer, mtp, params_per_layer, and a label
    such as "3–77: MoE, full".
    """
    runs: list[dict[str, Any]] = []
    for row in layers:
        kind = (row["mlp"], row["indexer"], row["mtp"], row["params"])
        last = runs[-1] if runs else None
        if last is not None and last["_kind"] == kind and last["last"] == row["index"] - 1:
            last["last"] = row["index"]
            last["count"] += 1
            continue
        runs.append({"_kind": kind, "first": row["index"], "last": row["index"], "count": 1,
                     "mlp": row["mlp"], "indexer": row["indexer"], "mtp": row["mtp"],
                     "params_per_layer": row["params"], "active_params_per_layer": row["active_params"]})
    for run in runs:
        del run["_kind"]
        span = str(run["first"]) if run["count"] == 1 else f"{run['first']}–{run['last']}"
        run["label"] = f"{span}: {layer_label(run)}"
    return runs


def parameter_report(args: Glm5Args) -> dict[str, Any]:
    """Total, active, per-group and per-layer parameter counts of `args`.

    Returns a JSON-serialisable dict with keys: total_params, total_params_with_mtp,
    mtp_params, active_params (headline: excl. input embedding),
    active_params_incl_embedding, active_params_excl_embedding_and_head,
    params_by_group, active_params_by_group, layers, layer_runs, buffers.
    """
    model = build_model(args, device="meta")
    top_k = args.num_experts_per_tok
    layers = [_layer_row(i, layer, top_k, mtp=False) for i, layer in enumerate(model.model.layers)]
    layers += [_layer_row(args.num_hidden_layers + j, layer, top_k, mtp=True) for j, layer in enumerate(model.mtp)]

    by_group = count_by_group(model)
    active_by_group = dict(by_group)
    num_routed = num_routed_active = 0
    for layer in model.model.layers:
        routed, routed_active = _routed_active(layer.mlp, top_k)
        num_routed += routed
        num_routed_active += routed_active
    assert num_routed == by_group["routed_experts"]
    active_by_group["routed_experts"] = num_routed_active
    active_by_group["mtp"] = 0

    total_with_mtp = sum(by_group.values())
    total = total_with_mtp - by_group["mtp"]
    active_incl = sum(active_by_group.values())
    embedding, head = by_group["embeddings"], by_group["head"]  # head is 0 when tied
    active_excl_input = active_incl if args.tie_word_embeddings else active_incl - embedding

    buffers = {_BIAS_BUFFER: 0, f"{_BIAS_BUFFER}_mtp": 0}
    for name, buf in model.named_buffers():
        if name.endswith(_BIAS_BUFFER):
            key = f"{_BIAS_BUFFER}_mtp" if param_group(name) == "mtp" else _BIAS_BUFFER
            buffers[key] += buf.numel()

    return {
        "total_params": total,
        "total_params_with_mtp": total_with_mtp,
        "mtp_params": by_group["mtp"],
        "active_params": active_excl_input,
        "active_params_incl_embedding": active_incl,
        "active_params_excl_embedding_and_head": active_incl - embedding - head,
        "params_by_group": {g: by_group[g] for g in GROUPS},
        "active_params_by_group": {g: active_by_group[g] for g in GROUPS},
        "layers": layers,
        "layer_runs": layer_runs(layers),
        "buffers": buffers,
    }
