"""What `glmtune inspect` says of an `hf` family model, from config.json's shapes alone (no torch).

The parameters are memory_layout.py's, every parameter of transformers' model by the spec's groups
(norms, biases, q/k norms and a tied head included; the memory model's count, which tests hold equal
to transformers' own model): this module adds the per-token view and the per-layer table.

Conventions (GLM-5's, models/glm5/counts.py, so the two families' figures compare):
  * "active" is per token: every parameter but the routed experts, of which a token runs through
    `num_experts_per_tok` of `num_experts` in each MoE layer (the router and shared experts always);
  * the headline active count leaves out the input embedding (a lookup, not a matmul) and keeps the
    LM head; with tied embeddings the one matrix is the head, so nothing is left out.

A `model_type` whose layer memory_layout.py does not know is counted as Llama's layer: its count may
miss a few vectors per layer, and the report says so (`layout_known`).
"""

from __future__ import annotations

from typing import Any

from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.memory_layout import LAYOUTS, layer_parameters, parameter_counts
from glmtune.models.hf.shapes import active_matmul_params, parameter_count

GROUPS = ("embeddings", "attention", "mlp", "router", "experts", "norm", "head")


def architecture_summary(args: HfArgs) -> dict[str, Any]:
    """The hyper-parameters that shape the model, grouped by block (`glmtune inspect`, preflight)."""
    return {"architecture": args.architecture, "model_type": args.model_type,
            "num_hidden_layers": args.num_hidden_layers, "num_moe_layers": len(args.moe_layers),
            "num_dense_layers": args.num_hidden_layers - len(args.moe_layers),
            "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
            "tie_word_embeddings": args.tie_word_embeddings,
            "attention": {"num_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
                          "head_dim": args.head_dim},
            "mlp": {"intermediate_size": args.intermediate_size, "num_experts": args.num_experts,
                    "num_experts_per_tok": args.num_experts_per_tok,
                    "moe_intermediate_size": args.moe_intermediate_size, "n_shared_experts": args.n_shared_experts},
            # the matrices alone (shapes.py: what the FLOPs per token count)
            "matrix_parameters": parameter_count(args), "active_matmul_parameters": active_matmul_params(args)}


def architecture_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The architecture table `glmtune inspect` prints, from `architecture_summary`."""
    att, mlp = summary["attention"], summary["mlp"]
    rows = [("layers", f"{summary['num_hidden_layers']} ({summary['num_dense_layers']} dense + "
                       f"{summary['num_moe_layers']} MoE)"),
            ("hidden / vocab", f"{summary['hidden_size']} / {summary['vocab_size']}"
                               + (" (tied embeddings)" if summary["tie_word_embeddings"] else "")),
            ("attention", f"{att['num_heads']} query heads, {att['num_key_value_heads']} key/value heads, "
                          f"head dim {att['head_dim']}")]
    if summary["num_dense_layers"]:
        rows.append(("dense MLP", f"width {mlp['intermediate_size']}"))
    if summary["num_moe_layers"]:
        rows.append(("MoE", f"{mlp['num_experts']} experts (top-{mlp['num_experts_per_tok']}) + "
                            f"{mlp['n_shared_experts']} shared, width {mlp['moe_intermediate_size']}"))
    return rows


def _active(args: HfArgs, counts: dict[str, int]) -> dict[str, int]:
    """`counts` by group as one token runs through them: top-k of each MoE layer's routed experts."""
    active = dict(counts)
    if args.num_experts:
        assert counts["experts"] % args.num_experts == 0, counts  # stacked experts of one size
        active["experts"] = counts["experts"] // args.num_experts * args.num_experts_per_tok
    return active


def _layer_row(args: HfArgs, index: int) -> dict[str, Any]:
    counts = layer_parameters(args, index)
    return {"index": index, "mlp": "moe" if index in args.moe_layers else "dense",
            "params": sum(counts.values()), "active_params": sum(_active(args, counts).values())}


def layer_runs(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive layers of one kind and size merged: first, last, count, mlp, params_per_layer,
    active_params_per_layer and a label such as "1–47: MoE"."""
    runs: list[dict[str, Any]] = []
    for row in layers:
        last = runs[-1] if runs else None
        if last is not None and (last["mlp"], last["params_per_layer"]) == (row["mlp"], row["params"]) \
                and last["last"] == row["index"] - 1:
            last["last"], last["count"] = row["index"], last["count"] + 1
            continue
        runs.append({"first": row["index"], "last": row["index"], "count": 1, "mlp": row["mlp"],
                     "params_per_layer": row["params"], "active_params_per_layer": row["active_params"]})
    for run in runs:
        span = str(run["first"]) if run["count"] == 1 else f"{run['first']}–{run['last']}"
        run["label"] = f"{span}: {'MoE' if run['mlp'] == 'moe' else 'dense'}"
    return runs


def parameter_report(args: HfArgs) -> dict[str, Any]:
    """Total, active, per-group and per-layer parameter counts of `args` (module docstring): total_params,
    active_params (headline), active_params_incl_embedding, active_params_excl_embedding_and_head,
    params_by_group, active_params_by_group, layers, layer_runs, layout_known."""
    counts = parameter_counts(args)
    by_group = {group: counts.get(group, 0) for group in GROUPS}
    assert sum(by_group.values()) == sum(counts.values()), counts  # no group outside the spec's
    active_by_group = _active(args, by_group)
    active = sum(active_by_group.values())
    embedding, head = by_group["embeddings"], by_group["head"]  # head is 0 when tied
    layers = [_layer_row(args, i) for i in range(args.num_hidden_layers)]
    return {
        "total_params": sum(by_group.values()),
        "active_params": active if args.tie_word_embeddings else active - embedding,
        "active_params_incl_embedding": active,
        "active_params_excl_embedding_and_head": active - embedding - head,
        "params_by_group": by_group,
        "active_params_by_group": active_by_group,
        "layers": layers,
        "layer_runs": layer_runs(layers),
        "layout_known": args.model_type in LAYOUTS,
    }
