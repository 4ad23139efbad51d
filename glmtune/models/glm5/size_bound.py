"""How many parameters a GLM-5 config.json describes, and the most glmtune takes on its word.

A config.json read with no weights beside it (`glmtune config validate` or `glmtune plan` on a
downloaded config, a recipe's placeholder) has nothing to check its sizes against, and every
size it gives is a number someone typed: `vocab_size: 10**12` describes a 6-quadrillion-
parameter model that a plan would size memory for. `check_parameter_count` refuses a config
describing more than `MAX_PARAMETERS`: 10^13, about 13 times GLM-5's 7.5 * 10^11 (20 TB of
bf16 weights: beyond any machine glmtune plans for, while leaving room for larger releases).
A config that comes with weights is checked against them instead (checkpoint/hf_verify.py).

`parameter_count` is exact without building the model at its size or its depth: each layer's
parameters depend only on its kind (dense or MoE MLP, full or shared indexer), so two-layer
models on the meta device, one per MLP kind, give every kind's count (a 10,000-layer config
costs what a 2-layer one does), plus the embedding, norm, head and MTP layer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from torch import nn

from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import build_model

MAX_PARAMETERS = 10**13


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _small_model(args: Glm5Args, mlp_kind: str | None) -> nn.Module:
    """Two layers of `mlp_kind` (a full then a shared indexer; no layer for None) and at most one
    MTP layer, on the meta device; ValueError when a size is past any machine."""
    layers = [] if mlp_kind is None else [mlp_kind, mlp_kind]
    small = args.replace(num_hidden_layers=len(layers), mlp_layer_types=layers,
                         indexer_types=["full", "shared"][: len(layers)],
                         num_nextn_predict_layers=min(args.num_nextn_predict_layers, 1))
    try:
        return build_model(small, device="meta")
    except (RuntimeError, TypeError, OverflowError) as exc:  # torch: a tensor of more than 2^63 bytes
        raise ValueError(f"its sizes describe a tensor no machine holds ({str(exc)[:160]})") from None


def parameter_count(args: Glm5Args) -> int:
    """Parameters of the model `args` describes, MTP layers included (as `counts.parameter_report`'s
    total_params_with_mtp), from small models on the meta device (module docstring)."""
    kinds = Counter(zip(args.mlp_layer_types, args.indexer_types))
    per_layer: dict[tuple[str, str], int] = {}
    outside_layers = mtp_layer = 0
    for mlp_kind in sorted({mlp for mlp, _ in kinds}) or [None]:
        model = _small_model(args, mlp_kind)
        layers = list(model.model.layers)
        per_layer.update({(mlp_kind, indexer): _count(layer) for indexer, layer in zip(("full", "shared"), layers)})
        mtp_layer = _count(model.mtp[0]) if len(model.mtp) else 0
        outside_layers = _count(model) - sum(_count(layer) for layer in layers) - mtp_layer
    return (outside_layers + sum(n * per_layer[kind] for kind, n in kinds.items())
            + args.num_nextn_predict_layers * mtp_layer)


def check_parameter_count(args: Glm5Args, config: str | Path) -> None:
    """ValueError naming `config` when it describes more than `MAX_PARAMETERS` parameters, or
    sizes no machine holds (a config.json with no weights to check it against)."""
    try:
        count = parameter_count(args)
    except ValueError as exc:
        raise ValueError(f"{config}: {exc}") from None
    if count > MAX_PARAMETERS:
        raise ValueError(f"{config}: describes a model of {count:,} parameters, more than the {MAX_PARAMETERS:,} "
                         "glmtune takes from a config.json with no weights to check it against (GLM-5 has "
                         "7.5 * 10^11); check its sizes (vocab_size, hidden_size, n_routed_experts, ...)")
