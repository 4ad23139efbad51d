"""DSA sparse attention through FlexAttention: block-sparse tiles, the top-k mask read per tile.

The "sdpa" backend runs queries past the causal prefix with a boolean mask, dense over
every key up to the query block's end. Here the same queries run through
`torch.nn.attention.flex_attention` with a `BlockMask` built from the sparse mask:
key tiles no query of a tile may see (the future, other documents) are skipped, tiles
every query sees in full run without reading the mask, and only the rest read it.
The arithmetic is flash attention's (online softmax, fp32 statistics), so it matches
the eager reference to rounding; `tests/models/test_attention_backends.py` checks the
forward on CPU and the benchmark checks training on GPU (FlexAttention has no CPU
backward).

One-document rows keep the exact shortcut of "sdpa": the first `causal_prefix`
queries (which select every key of their past) run as plain causal flash attention.

Legend: B batch, N heads, S queries, T keys, K qk head dim, V value head dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

BLOCK = 128  # BlockMask tile (queries and keys)
# FlexAttention's default tiles need 237 KB of shared memory at qk 192 / v 256, over an H200's
# 227 KB; these fit (benchmarks/dsa_kernels.py tries the alternatives).
KERNEL_OPTIONS: dict | None = {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2}


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(q_BNSK, k_BNTK, v_BNTV, block_mask, scale):
    if q_BNSK.device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention(q_BNSK, k_BNTK, v_BNTV, block_mask=block_mask, scale=scale,
                              kernel_options=KERNEL_OPTIONS)
    return _compiled_flex()(q_BNSK, k_BNTK, v_BNTV, block_mask=block_mask, scale=scale,
                            kernel_options=KERNEL_OPTIONS)


def sparse_block_mask(mask_BST: torch.Tensor):
    """A BlockMask whose mask_mod reads the boolean [B, S, T] mask (True = attend)."""
    batch, seq_q, seq_k = mask_BST.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_BST[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, batch, None, seq_q, seq_k, device=mask_BST.device, BLOCK_SIZE=BLOCK)


def flex_sparse_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, scale, causal_prefix: int = 0):
    """Attention of every query over its allowed-and-selected keys ([B, N, S, V]).

    `causal_prefix` queries from the start attend exactly their causal past (flash SDPA);
    the rest use the block-sparse mask.
    """
    seq_len = q_BNSK.shape[2]
    if causal_prefix >= seq_len:
        return F.scaled_dot_product_attention(q_BNSK, k_BNTK, v_BNTV, is_causal=True, scale=scale)
    p = causal_prefix
    tail = _flex(q_BNSK[:, :, p:], k_BNTK, v_BNTV, sparse_block_mask(sparse_BST[:, p:]), scale)
    if p == 0:
        return tail
    head = F.scaled_dot_product_attention(q_BNSK[:, :, :p], k_BNTK[:, :, :p], v_BNTV[:, :, :p],
                                          is_causal=True, scale=scale)
    return torch.cat([head, tail], dim=2)
