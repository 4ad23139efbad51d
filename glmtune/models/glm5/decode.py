"""GLM-5's cached decoding: the forward over new tokens with a `DecodeCache` (prefill chunks and
decode steps), and `GLM5_DECODING`, the hooks the spec gives `glmtune.generation.generate`.

It runs the very modules of `Glm5ForCausalLM` (their weights, norms, rope, MoE) in the order
of the training forward (`DecoderLayer.forward`, `MLAttention.forward`); only where keys
come from differs: the S new tokens' compressed KV and indexer keys are written into the
cache, and their queries attend all T cached positions. For each new query

  * the allowed keys are the cached positions up to and including its own, minus padding;
  * a full-indexer layer scores the query against every cached indexer key (fp32, the
    training forward's `Indexer.combine`) and keeps the top-k allowed ones; with at most
    top-k allowed keys every one of them is selected (what training does for the first
    top-k queries of a row);
  * a shared-indexer layer reuses the selection of the latest full layer before it;
  * attention is the layer's backend arithmetic over the selected keys ("eager": the
    additive-mask reference; any other backend: SDPA with the boolean mask).

so each logit is the full forward's at that position (up to matmul rounding; the tests
bound it). Left-padded rows: a pad query attends only itself (its output is never used;
it keeps the softmax finite), and no real query sees a pad key.

Legend: B batch, S new tokens, T cached positions, N heads, D model dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from glmtune.models.common.decoding import CachedDecoding, Gathered
from glmtune.models.common.rope import apply_interleaved_rope
from glmtune.models.glm5.attention import MLAttention, eager_attention
from glmtune.models.glm5.indexer import Indexer
from glmtune.models.glm5.kv_cache import DecodeCache, LayerCache
from glmtune.models.glm5.model import DecoderLayer, Glm5ForCausalLM


@torch.no_grad()
def forward_cached(model: Glm5ForCausalLM, ids_BS: torch.Tensor, positions_BS: torch.Tensor,
                   valid_BS: torch.Tensor, cache: DecodeCache, gathered: Gathered | None = None) -> torch.Tensor:
    """Final-normed hidden states [B, S, D] of `ids_BS`, the next S positions of every row
    (`positions_BS`: rope positions; `valid_BS`: False for padding). Appends them to `cache`.
    `gathered(layer)`: a context in which a sharded layer's own weights are whole (FSDP2's
    unshard/reshard; the caller's lockstep); the layer's submodules are called directly here,
    so its forward hooks do not gather them. None: a model in one process."""
    batch, seq_len = ids_BS.shape
    start, end = cache.length, cache.length + seq_len
    if end > cache.max_len:
        raise ValueError(f"cache holds {cache.max_len} positions; {end} asked for")
    cache.valid_BT[:, start:end] = valid_BS
    h_BSD = model.model.embed_tokens(ids_BS)
    cos, sin = model.model.rotary_emb(positions_BS, h_BSD.dtype)
    query_S = torch.arange(start, end, device=ids_BS.device)
    key_T = torch.arange(end, device=ids_BS.device)
    causal_ST = query_S[:, None] >= key_T[None, :]
    allowed_BST = causal_ST & cache.valid_BT[:, None, :end]
    allowed_BST |= ~valid_BS[:, :, None] & (query_S[:, None] == key_T[None, :])  # a pad query: itself
    selection = None
    for layer, layer_cache in zip(model.model.layers, cache.layers):
        with gathered(layer) if gathered is not None else contextlib.nullcontext():
            attn_out, selection = _attention(layer.self_attn, layer.input_layernorm(h_BSD), cos, sin, allowed_BST,
                                             layer_cache, start, selection)
            h_BSD = h_BSD + attn_out
            h_BSD = h_BSD + layer.mlp(layer.post_attention_layernorm(h_BSD))
    cache.length = end
    return model.model.norm(h_BSD)


def _attention(attn: MLAttention, x_BSD, cos, sin, allowed_BST, cache: LayerCache, start: int, shared):
    """`MLAttention.forward` for S new tokens over the cached T (same ops, same order)."""
    batch, seq_len, _ = x_BSD.shape
    end = start + seq_len
    q_resid_BSR = attn.q_a_layernorm(attn.q_a_proj(x_BSD))
    q_BNSK = attn.q_b_proj(q_resid_BSR).view(batch, seq_len, attn.num_heads, attn.qk_dim).transpose(1, 2)
    q_nope, q_rot = q_BNSK.split([attn.nope_dim, attn.rope_dim], dim=-1)
    latent_BSR, k_rot_BSK = attn.kv_a_proj_with_mqa(x_BSD).split([attn.kv_rank, attn.rope_dim], dim=-1)
    latent_BSR = attn.kv_a_layernorm(latent_BSR)
    rope_cos, rope_sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = apply_interleaved_rope(q_rot, rope_cos, rope_sin)
    k_rot_B1SK = apply_interleaved_rope(k_rot_BSK.unsqueeze(1), rope_cos, rope_sin)
    cache.latent_BTR[:, start:end] = latent_BSR
    cache.k_rot_BTK[:, start:end] = k_rot_B1SK.squeeze(1)

    latent_BTR, k_rot_B1TK = cache.latent_BTR[:, :end], cache.k_rot_BTK[:, :end].unsqueeze(1)
    kv_BNTX = attn.kv_b_proj(latent_BTR).view(batch, end, attn.num_heads, -1).transpose(1, 2)
    k_nope, v_BNTV = kv_BNTX.split([attn.nope_dim, attn.v_dim], dim=-1)
    k_BNTK = torch.cat([k_nope, k_rot_B1TK.expand(-1, attn.num_heads, -1, -1)], dim=-1)
    q_BNSK = torch.cat([q_nope, q_rot], dim=-1)

    if attn.indexer is not None:
        indexer = attn.indexer
        q_BSHD, k_BSD, weights_BSH = indexer.project(x_BSD, q_resid_BSR, cos, sin)
        cache.index_keys_BTD[:, start:end] = k_BSD
        sparse_BST = topk_selection(q_BSHD, cache.index_keys_BTD[:, :end], weights_BSH, allowed_BST, indexer)
    else:
        assert shared is not None, "a shared-indexer layer needs an earlier full layer"
        sparse_BST = shared

    if attn.backend == "eager":
        out_BNSV = eager_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, attn.scale)
    else:
        out_BNSV = F.scaled_dot_product_attention(q_BNSK, k_BNTK, v_BNTV, attn_mask=sparse_BST.unsqueeze(1),
                                                  scale=attn.scale)
    out_BSX = out_BNSV.transpose(1, 2).reshape(batch, seq_len, attn.num_heads * attn.v_dim)
    return attn.o_proj(out_BSX), sparse_BST


def topk_selection(q_BSHD, k_BTD, weights_BSH, allowed_BST, indexer: Indexer) -> torch.Tensor:
    """Bool [B, S, T]: allowed and among the query's top-k index scores (all allowed keys
    when there are at most top-k positions)."""
    if k_BTD.shape[1] <= indexer.index_topk:
        return allowed_BST
    scores_BST = Indexer.combine(q_BSHD, k_BTD, weights_BSH, indexer.softmax_scale)
    scores_BST = scores_BST.masked_fill(~allowed_BST, torch.finfo(scores_BST.dtype).min)
    top_BSK = scores_BST.topk(indexer.index_topk, dim=-1, sorted=False).indices
    return allowed_BST & torch.zeros_like(allowed_BST).scatter_(-1, top_BSK, True)


class Glm5Decoding(CachedDecoding):
    """GLM-5's decoding hooks (`glmtune.models.common.decoding`): the cache of kv_cache.py and
    `forward_cached` above."""

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, Glm5ForCausalLM)

    def supported(self, model: nn.Module) -> bool:
        """A plain `Glm5ForCausalLM` in one process. `forward_cached` calls the layers' submodules
        itself, so sharded parameters (FSDP2, expert parallelism: DTensors), a sequence shard or
        pipeline stages, whose wrappers gather or route in their own forwards, are not supported
        (`glmtune.train.generate.greedy_generate` runs those)."""
        if not isinstance(model, Glm5ForCausalLM) or model.model.sequence_shard is not None:
            return False
        layers = list(model.model.layers)
        if len(layers) != model.args.num_hidden_layers:
            return False
        if not all(isinstance(getattr(layer, "_orig_mod", layer), DecoderLayer) for layer in layers):
            return False
        return not any(isinstance(p, DTensor) for p in model.parameters())

    def head(self, model: Glm5ForCausalLM) -> nn.Module:
        return model.lm_head

    def new_cache(self, model: Glm5ForCausalLM, batch: int, max_len: int) -> DecodeCache:
        weight = model.lm_head.weight
        return DecodeCache(model.args, batch, max_len, weight.dtype, weight.device)

    def forward(self, model: Glm5ForCausalLM, ids_BS: torch.Tensor, positions_BS: torch.Tensor,
                valid_BS: torch.Tensor, cache: DecodeCache, gathered: Gathered | None = None) -> torch.Tensor:
        return forward_cached(model, ids_BS, positions_BS, valid_BS, cache, gathered)

    def eos_token_ids(self, model: Glm5ForCausalLM) -> set[int]:
        eos = model.args.eos_token_id
        return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)

    def pad_token_id(self, model: Glm5ForCausalLM) -> int:
        return model.args.pad_token_id if model.args.pad_token_id is not None else 0


GLM5_DECODING = Glm5Decoding()
