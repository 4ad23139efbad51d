"""What GLM-5's K-layer view of a checkpoint keeps (`glmtune.checkpoint.truncated_view` writes it).

The view's architecture is the checkpoint's cut to its first K decoder layers, with no MTP
layer (`num_nextn_predict_layers` 0: on disk the MTP layer sits after the last decoder layer,
so a K-layer model would read layer K in its place); config.json gets the keys that change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.models.glm5.args import Glm5Args, truncated_args

# config.json keys a K-layer view rewrites (the others are the source's)
VIEW_KEYS = ("num_hidden_layers", "mlp_layer_types", "indexer_types", "num_nextn_predict_layers",
             "index_topk_pattern", "layer_types")


def view_args(src: str | Path, num_layers: int) -> tuple[Glm5Args, dict[str, Any]]:
    """(the architecture of the first `num_layers` layers of checkpoint `src`, the config.json
    keys the view rewrites).

    Raises:
        ValueError: `num_layers` is not below the checkpoint's layer count.
    """
    src = Path(src).resolve()
    args = Glm5Args.from_hf_config(src)
    if not 1 <= num_layers < args.num_hidden_layers:
        raise ValueError(f"--layers {num_layers}: {src} has {args.num_hidden_layers} decoder layers; "
                         f"a view keeps 1 to {args.num_hidden_layers - 1} of them")
    small = truncated_args(args, num_layers)
    return small, {k: v for k, v in small.to_hf_dict().items() if k in VIEW_KEYS}
