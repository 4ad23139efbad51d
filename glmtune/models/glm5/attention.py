"""Multi-head Latent Attention (MLA) with DSA sparse masking, as in GLM-5.

Queries go through a low-rank bottleneck (q_a -> RMSNorm -> q_b); keys and values
come from a shared 512-dim latent plus one 64-dim rope key shared by all heads
(kv_a_proj_with_mqa -> RMSNorm -> kv_b). Per head the query/key is
[nope 192 | rope 64] and the value is 256 wide; scale is 1/sqrt(qk_head_dim).

The attention itself is a backend chosen by name:
  * "eager": the reference; the exact arithmetic of transformers' eager path
    (additive finfo.min mask, fp32 softmax cast back before the PV product).
  * "sdpa": `F.scaled_dot_product_attention`. For rows holding one document the
    first `index_topk` queries have at most k allowed keys, all selected, so they
    run as plain causal attention (`is_causal=True`: no mask tensor, the flash
    kernel) and only the later queries use the boolean top-k mask, in blocks that
    read only the keys up to the block's end; a row no longer than k is causal
    throughout. Packed rows use the blocked boolean mask everywhere.
  * "flex": the same causal prefix; everything else through FlexAttention with a
    block-sparse mask (`flex_attention.py`). GPU training; CPU forward only.
  * "gemm": the same causal prefix and blocks as "sdpa"; the masked blocks as explicit
    batched GEMMs with fp32 scores and flash's roundings (`gemm_attention.py`): cuBLAS
    speed instead of a fused kernel's masked path, at the cost of score-sized traffic.
  * "triton": the same causal prefix; all later queries in one call of the masked flash
    kernels (`triton_attention.py`), which read the top-k mask per tile and skip tiles with
    no allowed key. CUDA only (the kernels' CPU tests run in Triton's interpreter).
  * "absorbed": MLA in its absorbed (MQA) form over each query's selected keys only
    (`absorbed_attention.py`), as DeepSeek-V3.2 trains DSA: kv_b never runs over the keys
    (W_uk folds into the queries, W_uv into the output latent), every query gathers its
    (at most `index_topk`) compressed keys, the causal prefix included. kv_b over the keys
    runs only for the indexer's KL, when it is requested. Needs a plain bf16/fp32 kv_b_proj
    (no FP8 base, no kv_b_proj adapter: `config/validate.py` refuses both).
  * "absorbed_triton": "absorbed" computed by fused Triton kernels that gather each query's
    keys on chip and add the keys' gradients with atomics (`sparse_mla_attention.py`); its
    torch blocks are the reference. CUDA, bf16/fp16 only.
  * "auto" (the default): "triton" for bf16/fp16 CUDA tensors (when Triton is installed),
    "sdpa" elsewhere.

Under context parallelism (a `SequenceShard` passed to the layer) this rank's queries are
a few pieces of the row: the compressed KV (normed latent | roped k_rot) of every token is
all-gathered, kv_b runs over the keys up to the last local query, and each piece
[o, o + n) attends keys [0, o + n) through the same backend (its queries are the last n of
those keys); the is_causal prefix applies only to the piece at o = 0, where query i is key i.
The absorbed backends take the gathered compressed KV as their keys as it is, all pieces in
one call.

Legend: B batch, S queries, T keys, N heads, R latent rank, D model dim.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from glmtune.kernels.sparse_attention import SCORE_BUFFER_BYTES
from glmtune.models.common.rmsnorm import RMSNorm
from glmtune.models.common.rope import apply_interleaved_rope, softmax_scale_for
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.models.glm5.absorbed_attention import absorbed_sparse_attention
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.flex_attention import flex_sparse_attention
from glmtune.models.glm5.gemm_attention import gemm_masked_attention
from glmtune.models.glm5.indexer import Indexer
from glmtune.models.glm5.indexer_loss import IndexerKLRequest
from glmtune.models.glm5.indexer_loss import indexer_kl as indexer_kl_stats
from glmtune.models.glm5.triton_attention import triton_attention_available, triton_masked_attention

ATTENTION_BACKENDS = ("auto", "eager", "sdpa", "flex", "gemm", "triton", "absorbed", "absorbed_triton")
ABSORBED_BACKENDS = ("absorbed", "absorbed_triton")


def eager_attention(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale):
    logits_BNST = torch.matmul(q_BNSK, k_BNTK.transpose(2, 3)) * scale
    bias_BST = torch.zeros(allowed_BST.shape, dtype=q_BNSK.dtype, device=q_BNSK.device)
    bias_BST = bias_BST.masked_fill(~allowed_BST, torch.finfo(q_BNSK.dtype).min)
    logits_BNST = logits_BNST + bias_BST.unsqueeze(1)
    probs_BNST = F.softmax(logits_BNST, dim=-1, dtype=torch.float32).to(q_BNSK.dtype)
    return torch.matmul(probs_BNST, v_BNTV)


def _sdpa_masked(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale):
    return F.scaled_dot_product_attention(q_BNSK, k_BNTK, v_BNTV, attn_mask=allowed_BST.unsqueeze(1), scale=scale)


MASKED_BLOCK_FUNCTIONS = {"sdpa": _sdpa_masked, "gemm": gemm_masked_attention, "triton": triton_masked_attention}


def sdpa_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, scale, causal_prefix: int = 0, query_block: int = 1024,
                   masked=_sdpa_masked):
    """SDPA over a causal sparse mask, skipping keys no query of a block can see.

    The S queries are the last S of the T keys (T == S in one process; a context-parallel
    piece at row offset T - S otherwise). `causal_prefix` queries (from the start; only
    when T == S) attend exactly their causal past: they run with `is_causal=True` (flash,
    no mask tensor). The remaining queries run in blocks of `query_block` through `masked`
    (SDPA with the boolean mask, or the GEMM backend); a block [a, b) only reads keys
    [0, offset + b), since later keys are in every one of its queries' future. Both are
    exact: they drop only masked-out keys.
    """
    seq_len = q_BNSK.shape[2]
    offset = k_BNTK.shape[2] - seq_len
    assert offset == 0 or causal_prefix == 0, "is_causal aligns query i with key i"
    if causal_prefix >= seq_len:
        return F.scaled_dot_product_attention(q_BNSK, k_BNTK, v_BNTV, is_causal=True, scale=scale)
    # The query blocks are pieces of one split (its backward: one concatenation of their gradients,
    # where slices would each write a zero-filled copy of q to add up), and a block that reads every
    # key takes k and v themselves, not a whole-length slice (whose backward is such a copy too).
    starts = [0] * (causal_prefix > 0) + list(range(causal_prefix, seq_len, query_block))
    sizes = [end - start for start, end in zip(starts, [*starts[1:], seq_len])]
    queries = q_BNSK.split(sizes, dim=2)
    parts = []
    if causal_prefix > 0:
        p = causal_prefix
        parts.append(F.scaled_dot_product_attention(queries[0], k_BNTK[:, :, :p], v_BNTV[:, :, :p],
                                                    is_causal=True, scale=scale))
    for q_block, start in zip(queries[len(parts):], starts[len(parts):]):
        end = start + q_block.shape[2]
        keys = offset + end
        k_block, v_block = (k_BNTK, v_BNTV) if keys == k_BNTK.shape[2] else (k_BNTK[:, :, :keys], v_BNTV[:, :, :keys])
        parts.append(masked(q_block, k_block, v_block, sparse_BST[:, start:end, :keys], scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class MLAttention(nn.Module):
    def __init__(self, args: Glm5Args, has_indexer: bool, backend: str = "auto",
                 indexer_backend: str = "auto") -> None:
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} unknown; choose from {ATTENTION_BACKENDS}")
        self.backend = backend
        self.num_heads = args.num_attention_heads
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        self.qk_dim = args.qk_head_dim
        bias = args.attention_bias
        self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank)  # eps 1e-6, as transformers builds it
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, args.hidden_size, bias=bias)
        self.scale = softmax_scale_for(args.rope_parameters, self.qk_dim)
        self.index_topk = args.index_topk
        self.query_block = 1024  # sdpa backend: queries per masked block (keys beyond a block are skipped)
        self.score_buffer_bytes = SCORE_BUFFER_BYTES  # triton, absorbed_triton: bound on the backward's dS / P buffers
        self.indexer = Indexer(args, indexer_backend) if has_indexer else None
        self.index_softmax_scale = args.index_head_dim**-0.5  # every indexer's (shared layers': the owner's)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed_BST: torch.Tensor,
        shared: tuple[torch.Tensor, bool] | None = None,
        plain_causal: bool = False,
        sparse_needed: bool = True,
        shard: SequenceShard | None = None,
        indexer_kl: IndexerKLRequest | None = None,
    ) -> tuple[torch.Tensor, tuple]:
        """Returns the attention output [B, S, D] and the sparse selection this layer used
        (mask [B, S, T], whether it selects every allowed key).

        `shared` is the previous full layer's selection; layers without an indexer
        ("shared" in GLM-5.2+) reuse it. `plain_causal` says `allowed_BST` is the
        ordinary causal mask (one document per row).

        Under context parallelism (`shard`) the S queries are this rank's share of rows
        of T tokens (cos/sin and `allowed_BST` [B, S, T] of those queries): the compressed
        KV of every token (normed latent | roped k_rot) is all-gathered, kv_b runs over the
        keys up to the last local query, and each piece of local queries attends its
        causal past through the backend.

        `indexer_kl` (`indexer_loss.py`): a third value, the [2] (KL sum, counted queries) of
        the selecting indexer against this layer's attention, differentiable with respect to
        that indexer only. The selection then carries the indexer's projections (with their
        graph) as a third element, for the shared-indexer layers that reuse it.
        """
        batch, seq_len, _ = x_BSD.shape
        q_BNSK, q_resid_BSR, latent_BSR, k_rot_B1SK = self.project(x_BSD, cos, sin)
        if shard is None:
            latent_BTR, k_rot_B1TK = latent_BSR, k_rot_B1SK
        else:
            latent_BTR, k_rot_B1TK = self._gathered_keys(latent_BSR, k_rot_B1SK, shard, allowed_BST.shape[-1])
        k_BNTK = v_BNTV = None  # the absorbed backends never expand the keys (but for the indexer's KL)
        if self.backend not in ABSORBED_BACKENDS or indexer_kl is not None:
            k_BNTK, v_BNTV = self.keys_and_values(latent_BTR, k_rot_B1TK)

        selection = self._selection(x_BSD, q_resid_BSR, cos, sin, allowed_BST, shared, plain_causal, sparse_needed,
                                    shard, indexer_kl)
        sparse_BST, all_selected = selection[:2]

        if self.backend in ABSORBED_BACKENDS:
            # A query has at most top-k keys, or, all selected, its allowed ones: at most k, or the
            # longest document's under the indexer warm-up's dense attention (which asks for the KL).
            slots = indexer_kl.most_keys if all_selected and indexer_kl is not None else self.index_topk
            out_BSX = self._absorbed_attend(q_BNSK, latent_BTR, k_rot_B1TK, sparse_BST, slots)
        else:
            out_BNSV = self._attend_pieces(q_BNSK, k_BNTK, v_BNTV, sparse_BST, all_selected, plain_causal, shard,
                                           allowed_BST.shape[-1])
            out_BSX = out_BNSV.transpose(1, 2).reshape(batch, seq_len, self.num_heads * self.v_dim)
        if indexer_kl is None:
            return self.o_proj(out_BSX), selection
        kl_stats = self._indexer_kl(q_BNSK, k_BNTK, latent_BTR, k_rot_B1TK, selection, indexer_kl, shard,
                                    allowed_BST.shape[-1])
        return self.o_proj(out_BSX), selection, kl_stats

    def _selection(self, x_BSD, q_resid_BSR, cos, sin, allowed_BST, shared, plain_causal: bool, sparse_needed: bool,
                   shard: SequenceShard | None, indexer_kl: IndexerKLRequest | None) -> tuple:
        """The keys each query attends: this layer's indexer's selection, or the earlier full layer's."""
        if self.indexer is None:
            assert shared is not None, "a shared-indexer layer needs an earlier full layer"
            return shared
        # The warm-up runs the main model without gradients: the indexer's KL graph is built anyway.
        with torch.enable_grad() if indexer_kl is not None and indexer_kl.indexer_only else nullcontext():
            return self.indexer(x_BSD, q_resid_BSR, cos, sin, allowed_BST, sparse_needed, plain_causal, shard,
                                keep_projections=indexer_kl is not None)

    def _indexer_kl(self, q_BNSK, k_BNTK, latent_BTR, k_rot_B1TK, selection: tuple, indexer_kl: IndexerKLRequest,
                    shard: SequenceShard | None, row_len: int) -> torch.Tensor:
        """The [2] (KL sum, counted queries) of the selecting indexer against this layer's attention."""
        assert len(selection) == 3, "the selecting layer ran without its indexer's KL"
        sparse_BST, all_selected = selection[:2]
        most_keys = indexer_kl.most_keys if all_selected else min(self.index_topk, indexer_kl.most_keys)
        pieces = None if shard is None else [n for piece in shard.pieces(row_len) for n in piece]
        kv_BTC = torch.cat([latent_BTR, k_rot_B1TK.squeeze(1)], dim=-1)
        w_kb_NPR = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)[:, :self.nope_dim]
        with torch.enable_grad() if indexer_kl.indexer_only else nullcontext():
            return indexer_kl_stats(q_BNSK, k_BNTK, kv_BTC, w_kb_NPR, self.scale, selection[2],
                                    self.index_softmax_scale, sparse_BST, indexer_kl.queries_BS, most_keys, pieces)

    def _attend_pieces(self, q_BNSK, k_BNTK, v_BNTV, sparse_BST, all_selected: bool, plain_causal: bool,
                       shard: SequenceShard | None, row_len: int) -> torch.Tensor:
        """[B, N, S, V]: every query over its selected keys through the backend; under a shard,
        piece by piece (each piece's queries are the last of the keys up to its end)."""
        if shard is None:
            causal_prefix = (q_BNSK.shape[2] if all_selected else self.index_topk) if plain_causal else 0
            return self._attend(q_BNSK, k_BNTK, v_BNTV, sparse_BST, causal_prefix)
        parts, local = [], 0
        for start, length in shard.pieces(row_len):
            end, rows = start + length, slice(local, local + length)
            # is_causal pairs query i with key i: only the piece at the row's start has that.
            causal_prefix = (length if all_selected else self.index_topk) if plain_causal and start == 0 else 0
            parts.append(self._attend(q_BNSK[:, :, rows], k_BNTK[:, :, :end], v_BNTV[:, :, :end],
                                      sparse_BST[:, rows, :end], causal_prefix))
            local += length
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _absorbed_attend(self, q_BNSK, latent_BTR, k_rot_B1TK, sparse_BST, slots: int) -> torch.Tensor:
        """The attention output [B, S, N x V] in the absorbed form: queries [q_nope W_uk | q_rot]
        [B, S, N, R + rope] over the compressed keys c = [latent | k_rot] [B, T, R + rope] that
        each selects (values: the latent), the output latent [B, S, N, R] through W_uv."""
        batch, _, seq_len, _ = q_BNSK.shape
        if type(self.kv_b_proj) is not nn.Linear:  # the config refuses these (config/validate.py)
            raise ValueError(f"model.attention_backend {self.backend!r} multiplies by kv_b_proj's weight itself: it takes "
                             "neither an FP8 base (model.fp8_base) nor a kv_b_proj adapter (peft.target_modules)")
        w_NXR = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk_NPR, w_uv_NVR = w_NXR.split([self.nope_dim, self.v_dim], dim=1)
        q_BSNK = q_BNSK.transpose(1, 2)  # q_b's own layout: no copy
        q_nope_BSNP, q_rot_BSNK = q_BSNK.split([self.nope_dim, self.rope_dim], dim=-1)
        q_lat_BSNR = torch.einsum("bsnp,npr->bsnr", q_nope_BSNP, w_uk_NPR)
        num_keys = latent_BTR.shape[1]
        # The parts as they are: the fused kernels read [q_lat | q_rot] and [latent | k_rot] from two
        # pointers each (under context parallelism latent and k_rot are views of one gathered tensor).
        out_BSNR = absorbed_sparse_attention(q_lat_BSNR, q_rot_BSNK, latent_BTR, k_rot_B1TK.squeeze(1),
                                             sparse_BST[..., :num_keys], self.scale, min(slots, num_keys),
                                             fused=self.backend == "absorbed_triton",
                                             buffer_bytes=self.score_buffer_bytes)
        out_BSNV = torch.einsum("bsnr,nvr->bsnv", out_BSNR, w_uv_NVR)
        return out_BSNV.reshape(batch, seq_len, self.num_heads * self.v_dim)

    def project(self, x_BSD, cos, sin):
        """Roped queries [B, N, S, K] (nope | rope), the query latent q_resid [B, S, Q] (the indexer's
        input), the normed KV latent [B, S, R] and the roped shared rope key [B, 1, S, rope dim]."""
        batch, seq_len, _ = x_BSD.shape
        q_resid_BSR = self.q_a_layernorm(self.q_a_proj(x_BSD))
        q_BNSK = self.q_b_proj(q_resid_BSR).view(batch, seq_len, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rot = q_BNSK.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_a = self.kv_a_proj_with_mqa(x_BSD)
        latent_BSR, k_rot_BSK = kv_a.split([self.kv_rank, self.rope_dim], dim=-1)
        latent_BSR = self.kv_a_layernorm(latent_BSR)
        rope_cos, rope_sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot = apply_interleaved_rope(q_rot, rope_cos, rope_sin)
        k_rot_B1SK = apply_interleaved_rope(k_rot_BSK.unsqueeze(1), rope_cos, rope_sin)
        return torch.cat([q_nope, q_rot], dim=-1), q_resid_BSR, latent_BSR, k_rot_B1SK

    def keys_and_values(self, latent_BTR, k_rot_B1TK):
        """Per-head keys [B, N, T, K] (kv_b's nope part | the shared rope key) and values [B, N, T, V]."""
        batch, num_keys, _ = latent_BTR.shape
        kv_BNTX = self.kv_b_proj(latent_BTR).view(batch, num_keys, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BNTV = kv_BNTX.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rot_B1TK.expand(-1, self.num_heads, -1, -1)], dim=-1), v_BNTV

    def _gathered_keys(self, latent_BSR, k_rot_B1SK, shard: SequenceShard, seq_len: int):
        """Every token's normed latent [B, T', R] and roped k_rot [B, 1, T', K] from all cp ranks,
        T' = one past this rank's last query (later keys are in every local query's future):
        one all-gather of R + K values per token."""
        compressed_BSC = torch.cat([latent_BSR, k_rot_B1SK.squeeze(1)], dim=-1)
        compressed_BTC = shard.gather(compressed_BSC)[:, :shard.key_end(seq_len)]
        latent_BTR, k_rot_BTK = compressed_BTC.split([self.kv_rank, self.rope_dim], dim=-1)
        return latent_BTR, k_rot_BTK.unsqueeze(1)

    def _attend(self, q_BNSK, k_BNTK, v_BNTV, sparse_BST, causal_prefix: int):
        """The backend over queries that are the last S of the T keys (`sdpa_attention`)."""
        seq_len = q_BNSK.shape[2]
        backend = self.backend
        if backend == "auto":
            half = q_BNSK.dtype in (torch.bfloat16, torch.float16)  # fp32 on GPU: sdpa's exact fp32 math
            backend = "triton" if q_BNSK.is_cuda and half and triton_attention_available() else "sdpa"
        if backend == "eager":
            return eager_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, self.scale)
        if backend == "flex":
            return flex_sparse_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, self.scale, causal_prefix)
        # The Triton kernels skip future keys per tile themselves: the whole tail is one block.
        query_block = seq_len if backend == "triton" else self.query_block
        masked = MASKED_BLOCK_FUNCTIONS[backend]
        if backend == "triton":
            masked = functools.partial(masked, score_buffer_bytes=self.score_buffer_bytes)
        return sdpa_attention(q_BNSK, k_BNTK, v_BNTV, sparse_BST, self.scale, causal_prefix, query_block, masked)

    def reset_parameters(self, std: float) -> None:
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_a_layernorm.reset_parameters()
        self.kv_a_layernorm.reset_parameters()
        if self.indexer is not None:
            self.indexer.reset_parameters(std)


def set_attention_score_buffer(model: nn.Module, mib: int) -> None:
    """Bounds the dS and P buffers (MiB each) that every layer's Triton attention backward may
    materialize (`model.attention_score_buffer_mib`; 0: "triton" recomputes them in its kernels,
    "absorbed_triton" fills them one query at a time)."""
    if mib < 0:
        raise ValueError(f"model.attention_score_buffer_mib must be >= 0, got {mib}")
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.score_buffer_bytes = mib << 20
