"""Model FLOPs per trained token of a GLM-5 proxy: the package's formula (glmtune/models/glm5/flops.py).

    6 x (active matmul parameters: MLA projections, dense MLP, top-k + shared experts,
         router, lm_head; the input embedding is a lookup, not a matmul)
  + 3 x causal attention over the keys the DSA indexer selects (QK^T and PV, forward)

The frozen indexer's own matmuls are not counted (no backward); this matches the
anchor figures in ../shared/bench, so MFU numbers are comparable.
"""

from __future__ import annotations

# The formula lives in the package: the trainer reports TFLOP/s and MFU with the same one.
from glmtune.models.glm5.flops import active_matmul_params, attention_flops_forward, flops_per_token  # noqa: F401
