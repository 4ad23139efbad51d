"""GLM-5's decoding cache: per decoder layer MLA's compressed KV and the DSA indexer's keys.

What a layer keeps per token (never the per-head keys and values, which kv_b_proj expands
from the latent again at each step):

  * `latent_BTR` [B, T, kv_lora_rank]: the kv_a latent after kv_a_layernorm,
  * `k_rot_BTK` [B, T, qk_rope_head_dim]: the shared rope key, already rotated,
  * `index_keys_BTD` [B, T, index_head_dim]: the indexer's keys (roped, k-normed), only in
    full-indexer layers; shared-indexer layers reuse the previous full layer's selection.

Buffers are allocated once for the longest row (prompt + max_new_tokens); `length` says how
many positions are filled. `valid_BT` marks real tokens (False for left padding), so a query
never attends a pad key and the indexer never selects one.

Legend: B batch, T cache positions, R latent rank, K rope dim, D indexer head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmtune.models.glm5.args import Glm5Args


@dataclass
class LayerCache:
    latent_BTR: torch.Tensor
    k_rot_BTK: torch.Tensor
    index_keys_BTD: torch.Tensor | None  # None: a shared-indexer layer


class DecodeCache:
    def __init__(self, args: Glm5Args, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        def buf(width: int) -> torch.Tensor:
            return torch.zeros(batch, max_len, width, dtype=dtype, device=device)

        self.layers = [
            LayerCache(buf(args.kv_lora_rank), buf(args.qk_rope_head_dim),
                       buf(args.index_head_dim) if kind == "full" else None)
            for kind in args.indexer_types
        ]
        self.valid_BT = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len

    def nbytes(self) -> int:
        """Bytes the buffers hold (all `max_len` positions)."""
        tensors = [self.valid_BT]
        for layer in self.layers:
            tensors += [t for t in (layer.latent_BTR, layer.k_rot_BTK, layer.index_keys_BTD) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def bytes_per_token(args: Glm5Args, dtype_bytes: int = 2) -> int:
    """Cache bytes one token costs over all decoder layers (MTP layers are not run):
    L * (kv_lora_rank + qk_rope_head_dim) + L_full * index_head_dim values, plus one
    validity byte. GLM-5 (78 layers, all full, bf16): 78 * (512 + 64 + 128) * 2 + 1 = 109,825."""
    num_full = sum(kind == "full" for kind in args.indexer_types)
    values = len(args.indexer_types) * (args.kv_lora_rank + args.qk_rope_head_dim) + num_full * args.index_head_dim
    return values * dtype_bytes + 1
