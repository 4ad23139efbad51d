"""GLM-5 causal LM (`GlmMoeDsaForCausalLM`) in plain PyTorch.

    embed -> [decoder layer] x L -> RMSNorm -> lm_head (untied)
    decoder layer: h += MLA(norm(h)); h += (dense MLP | MoE)(norm(h))

The module tree uses transformers' in-memory names (`model.layers.3.mlp.experts.
gate_up_proj`, ...) so adapters and PEFT exports line up with it; the HF checkpoint
mapping itself lives only in `state_dict_adapter.py`. Multi-token-prediction
(MTP) layers are built (under `mtp`) so checkpoints keep their weights through a
load/save round trip; the first one runs only when its loss is asked for
(a micro-batch with `mtp_targets`, `train.mtp_loss_weight`):

    MTP at t:  eh_proj([enorm(embed(x[t+1])); hnorm(h[t])]) -> decoder layer -> shared_head.norm
               -> lm_head -> token t+2

h[t] being the main model's final-normed hidden state (what serving engines hand their MTP
drafter). Its loss is attached to the main loss's backward (`models/common/aux_loss.py`).

The forward takes the token ids and a `MicroBatch` (`models/common/microbatch.py`): positions,
documents, targets, their host facts and the auxiliary losses' sizes.

The model knows nothing of parallelism; `parallelize_glm5()` transforms it. Under
context parallelism it is handed a `SequenceShard` (`Glm5Model.sequence_shard`): it
then takes the full rows, computes only this rank's queries of them, and gathers keys
through the shard's injected `gather` (`glmtune/models/common/sequence_shard.py`).

Legend: B batch, S queries (this rank's: T / cp under context parallelism, else T),
T tokens of a row, D model dim, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from glmtune.models.common.aux_loss import AuxiliaryScales, attach
from glmtune.models.common.document_masks import allowed_mask, longest_document, single_document_rows
from glmtune.models.common.loss import IGNORE_INDEX, chunked_cross_entropy, chunked_greedy, chunked_token_logps
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.rmsnorm import RMSNorm
from glmtune.models.common.rope import RotaryEmbedding
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.fp8_base import convert_to_fp8_base
from glmtune.models.glm5.indexer_loss import IndexerKL, IndexerKLRequest
from glmtune.models.glm5.moe import DenseMLP, MoE


@dataclass
class Glm5Output:
    logits: torch.Tensor | None  # [B, S, V] in the model dtype, or None when not asked for
    hidden_states: torch.Tensor  # [B, S, D] after the final norm
    loss_sum: torch.Tensor | None = None  # fp32 sum of token losses, when targets were given
    num_targets: torch.Tensor | None = None  # supervised tokens in loss_sum (or token_logps)
    token_logps: torch.Tensor | None = None  # [B, S] fp32 log p(target), 0 where -100 (forward(token_logps=True))
    mtp_loss_sum: torch.Tensor | None = None  # fp32 sum of the MTP layer's token losses (`mb.mtp_targets`)
    mtp_num_targets: torch.Tensor | None = None  # supervised tokens in mtp_loss_sum
    mtp_hidden_states: torch.Tensor | None = None  # [B, S, D] the MTP layer's head input (shared_head.norm applied)
    # MTP acceptance over the MTP-supervised positions t (those whose t+1 the main loss supervises, as in
    # every batch glmtune builds): the MTP layer's greedy token for t+2 equals the model's own greedy
    # token at t+1 (what speculative decoding accepts), as (accepted, positions)
    mtp_accepted: torch.Tensor | None = None
    # fp64 [2]: the indexers' KL summed over the layers and non-padding queries, and their number
    # (layers x queries); a micro-batch whose `aux` runs the indexer loss
    indexer_kl: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, args: Glm5Args, layer_idx: int, attention_backend: str, moe_backend: str,
                 has_indexer: bool | None = None, sparse_mlp: bool | None = None,
                 indexer_backend: str = "auto") -> None:
        super().__init__()
        if has_indexer is None:
            has_indexer = args.indexer_types[layer_idx] == "full"
        if sparse_mlp is None:
            sparse_mlp = args.mlp_layer_types[layer_idx] == "sparse"
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = MLAttention(args, has_indexer, attention_backend, indexer_backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args, moe_backend) if sparse_mlp else DenseMLP(args.hidden_size, args.intermediate_size)

    def forward(self, h_BSD, cos, sin, allowed_BST, shared=None, plain_causal=False, sparse_needed=True,
                shard=None, indexer_kl: IndexerKLRequest | None = None):
        """(hidden states, selection), and with `indexer_kl` a third value: the [2] (KL sum, counted
        queries) of the selecting indexer against this layer's attention (`indexer_loss.py`). In the
        warm-up (`indexer_kl.indexer_only`) the layer is called with gradients (a sharded wrapper then
        prepares the indexer's backward) and computes without them, but for the indexer and its KL."""
        with torch.no_grad() if indexer_kl is not None and indexer_kl.indexer_only else contextlib.nullcontext():
            attn_out, selection, *kl = self.self_attn(self.input_layernorm(h_BSD), cos, sin, allowed_BST, shared,
                                                      plain_causal, sparse_needed, shard, indexer_kl)
            h_BSD = h_BSD + attn_out
            h_BSD = h_BSD + self.mlp(self.post_attention_layernorm(h_BSD))
        return (h_BSD, selection, *kl)

    def reset_parameters(self, std: float) -> None:
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()
        self.self_attn.reset_parameters(std)
        self.mlp.reset_parameters(std)


class SharedHead(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction layer: a full MoE decoder layer with an indexer plus glue.

    DeepSeek-style MTP: h' = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]) feeds the
    decoder layer; shared_head.norm then the main lm_head predict token t+2.
    """

    def __init__(self, args: Glm5Args, layer_idx: int, attention_backend: str, moe_backend: str,
                 indexer_backend: str = "auto") -> None:
        super().__init__(args, layer_idx, attention_backend, moe_backend, has_indexer=True, sparse_mlp=True,
                         indexer_backend=indexer_backend)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.shared_head = SharedHead(args.hidden_size, args.rms_norm_eps)

    def forward(self, hidden_BSD, next_embeds_BSD, cos, sin, allowed_BST, plain_causal=False, sparse_needed=True,
                shard=None, indexer_kl: IndexerKLRequest | None = None):
        """The head input [B, S, D] predicting token t+2 from the main model's final-normed hidden
        state at t (`hidden_BSD`) and the embedding of token t+1 (`next_embeds_BSD`); the layer
        selects its keys with its own indexer. One call, so that a sharded wrapper (FSDP2) gathers
        the glue and the layer together. With `indexer_kl`: (head input, its indexer's KL [2])."""
        with torch.no_grad() if indexer_kl is not None and indexer_kl.indexer_only else contextlib.nullcontext():
            h_BSD = self.eh_proj(torch.cat([self.enorm(next_embeds_BSD), self.hnorm(hidden_BSD)], dim=-1))
        h_BSD, _, *kl = super().forward(h_BSD, cos, sin, allowed_BST, None, plain_causal, sparse_needed, shard,
                                        indexer_kl)
        return (self.shared_head.norm(h_BSD), *kl) if kl else self.shared_head.norm(h_BSD)

    def reset_parameters(self, std: float) -> None:
        super().reset_parameters(std)
        self.enorm.reset_parameters()
        self.hnorm.reset_parameters()
        self.shared_head.norm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)


@dataclass
class LayerInputs:
    """What every decoder layer of one forward shares, computed once per forward from the
    positions and documents (`Glm5Model.layer_inputs`): a pipeline stage computes it for
    its own layers from the same host facts."""

    cos: torch.Tensor  # [B, S, rope dim] rotary tables of the queries' positions
    sin: torch.Tensor
    allowed_BST: torch.Tensor  # bool [B, S, T]: causal and same document
    plain_causal: bool  # every row is one document: `allowed_BST` is the causal mask
    sparse_needed: bool  # some query of the rows has more allowed keys than the indexer's top-k
    shard: SequenceShard | None = None  # context parallelism: this rank's queries S of the T tokens
    # The indexers' KL loss of this forward (`indexer_loss.py`): every layer computes its KL and
    # `run_layers` attaches it to the layer's output and adds up its statistics here; None: off.
    indexer_kl: IndexerKL | None = None


class Glm5Model(nn.Module):
    """Embedding, decoder stack and final norm (transformers' `GlmMoeDsaModel`)."""

    def __init__(self, args: Glm5Args, attention_backend: str, moe_backend: str,
                 indexer_backend: str = "auto") -> None:
        super().__init__()
        self.padding_idx = args.pad_token_id
        self.index_topk = args.index_topk
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, attention_backend, moe_backend, indexer_backend=indexer_backend)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.qk_rope_head_dim, args.max_position_embeddings)
        # Context parallelism: which queries of each row this process computes (None: all of
        # them). Set by `glmtune.distributed.context_parallel.apply_context_parallel`.
        self.sequence_shard: SequenceShard | None = None

    def local_tokens(self, t_BT: torch.Tensor) -> torch.Tensor:
        """This process's tokens of a per-token tensor of the full rows ([B, T, ...] ->
        [B, S, ...]: ids, targets, positions); itself when there is no sequence shard."""
        return t_BT if self.sequence_shard is None else self.sequence_shard.local(t_BT)

    def layer_inputs(self, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype,
                     position_ids_BS=None, document_ids_BS=None, longest: int | None = None,
                     single_document: bool | None = None, indexer_grad_scale: float | None = None,
                     indexer_kl: bool = False, dense: bool = False, indexer_only: bool = False) -> LayerInputs:
        """The shared inputs of the decoder layers for rows of `seq_len` tokens.

        `longest` (`document_masks.longest_document`) and `single_document`
        (`document_masks.single_document_rows`) are host facts of the ids: omitted, they are
        computed here (a host sync when the ids are on the GPU; callers pass them from the
        host batch).

        Under a sequence shard, `seq_len` and the ids are those of the FULL rows (the same
        on every cp rank) and so are `longest` and `single_document`; the result describes
        this rank's S queries: cos/sin [B, S, rope dim] of their positions, `allowed_BST`
        [B, S, T] (causal by index in the row, same document) and the shard itself, which
        the layers use to gather keys. The hidden states fed to `run_layers` must then be
        the local tokens' ([B, S, D], e.g. `embed_tokens(local_tokens(ids))`).

        `indexer_kl`: the layers compute their indexer's KL over the queries of documents (not
        padding: `document_ids_BS` >= 0), attached with `indexer_grad_scale` (None: reported only).
        `dense`: every query attends all its allowed keys (the indexer warm-up); `indexer_only`:
        the caller runs the main model without gradients and only the KL graphs are built.
        """
        shard = self.sequence_shard
        query_index_S = None if shard is None else shard.query_index(seq_len, device)
        allowed_BST = allowed_mask(batch, seq_len, device, position_ids_BS, document_ids_BS, query_index_S)
        if longest is None:
            longest = longest_document(seq_len, position_ids_BS, document_ids_BS)
        if single_document is None:  # no row is one document when none is as long as the row
            single_document = longest == seq_len and single_document_rows(seq_len, position_ids_BS, document_ids_BS)
        if position_ids_BS is None:
            position_ids_BS = torch.arange(seq_len, device=device).unsqueeze(0)
        if shard is not None:
            position_ids_BS = shard.local(position_ids_BS)
        cos, sin = self.rotary_emb(position_ids_BS.expand(batch, -1), dtype)
        # does any query have more allowed keys than top-k? Asked of the full rows, so that
        # every cp rank takes the same path (the indexer's key gather is a collective).
        sparse_needed = longest > self.index_topk and not dense
        kl = None
        if indexer_kl:
            queries_BS = None if document_ids_BS is None else self.local_tokens(document_ids_BS.expand(batch, -1)) >= 0
            kl = IndexerKL(IndexerKLRequest(queries_BS, longest, indexer_only), indexer_grad_scale)
        return LayerInputs(cos, sin, allowed_BST, single_document, sparse_needed, shard, kl)

    @staticmethod
    def run_layers(layers, h_BSD: torch.Tensor, inputs: LayerInputs, selection=None):
        """`layers` in order over `h_BSD`; `selection` is the (sparse mask, selects-everything)
        of the latest full-indexer layer before them (None at the first layer). Returns the
        hidden states and the selection after the last of them."""
        kl = inputs.indexer_kl
        for layer in layers:
            # Only a layer without its own indexer reads the earlier selection: a full-indexer layer given
            # it would keep it, as a checkpointed layer keeps its inputs, until its backward for nothing
            # (bool [B, S, T] per layer and micro-batch in flight: 4.6 GiB on sft_32k_cp8's rank 384).
            shared = selection if layer.self_attn.indexer is None else None
            if kl is None:
                h_BSD, selection = layer(h_BSD, inputs.cos, inputs.sin, inputs.allowed_BST, shared,
                                         inputs.plain_causal, inputs.sparse_needed, inputs.shard)
                continue
            with kl.grad_context():  # the warm-up: each layer builds its indexer's graph
                h_BSD, selection, kl_stats = layer(h_BSD, inputs.cos, inputs.sin, inputs.allowed_BST, shared,
                                                   inputs.plain_causal, inputs.sparse_needed, inputs.shard,
                                                   kl.request)
            h_BSD = kl.collect(h_BSD, kl_stats)
        return h_BSD, selection

    def forward(self, input_ids_BS, position_ids_BS=None, document_ids_BS=None, longest: int | None = None,
                single_document: bool | None = None):
        """Final-normed hidden states [B, S, D] of the rows `input_ids_BS` [B, T] (this rank's
        queries under a sequence shard; every query otherwise)."""
        return self.hidden_and_inputs(input_ids_BS, position_ids_BS, document_ids_BS, longest, single_document)[0]

    def hidden_and_inputs(self, input_ids_BS, position_ids_BS=None, document_ids_BS=None,
                          longest: int | None = None, single_document: bool | None = None, **indexer_kl):
        """`forward`'s hidden states and the layers' shared inputs (`LayerInputs`: an MTP layer reuses
        them); `indexer_kl`: `layer_inputs`' indexer KL settings."""
        batch, seq_len = input_ids_BS.shape
        h_BSD = self.embed_tokens(self.local_tokens(input_ids_BS))
        inputs = self.layer_inputs(batch, seq_len, h_BSD.device, h_BSD.dtype, position_ids_BS, document_ids_BS,
                                   longest, single_document, **indexer_kl)
        h_BSD, _ = self.run_layers(self.layers, h_BSD, inputs)
        return self.norm(h_BSD), inputs

    def next_token_embeds(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, S, D] of the token after each local position (an MTP layer's input); the
        row's last position, which has none, gets the padding embedding (its MTP target is -100)."""
        filler = torch.full_like(input_ids_BT[:, :1], self.padding_idx or 0)
        return self.embed_tokens(self.local_tokens(torch.cat([input_ids_BT[:, 1:], filler], dim=1)))


class Glm5ForCausalLM(nn.Module):
    """The causal LM. `model(input_ids).logits` is [B, S, V]."""

    def __init__(self, args: Glm5Args, attention_backend: str = "auto", moe_backend: str = "grouped_mm",
                 indexer_backend: str = "auto") -> None:
        super().__init__()
        self.args = args
        self.model = Glm5Model(args, attention_backend, moe_backend, indexer_backend)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(
            MTPLayer(args, args.num_hidden_layers + j, attention_backend, moe_backend, indexer_backend)
            for j in range(args.num_nextn_predict_layers)
        )
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.freeze_untrained_by_default()

    def forward(self, input_ids, mb: MicroBatch | None = None, compute_logits: bool = True,
                token_logps: bool = False, loss_chunk_size: int = 2048) -> Glm5Output:
        """The rows `input_ids` [B, T] and what the micro-batch `mb` (`models/common/microbatch.py`)
        says of them (None: one document per row, positions 0..T-1, no loss). Under context
        parallelism (`model.sequence_shard`) `mb` describes the full rows and the outputs (hidden
        states, logits, loss sum and count) only this rank's queries: [B, S, ...], S = T / cp.

        From `mb`:
            position_ids, document_ids: [B, T] (or [1, T]) positions, whose restarts at 0 mark
                document starts, and documents of packed rows (they override the position split).
            longest_document, single_document: `document_masks` facts of the rows counted on the host
                (None: counted here, a host sync when the ids are on the GPU).
            targets: [B, T] next-token ids (-100 = no loss): the loss is computed here by the chunked
                cross-entropy (never all fp32 logits at once), inside forward so that sharded wrappers
                (FSDP2) have the head weight gathered. `num_supervised`: their count among this rank's
                queries, from the host (None: the loss finds the rows with a host sync); `loss_scale`:
                the factor the caller multiplies `loss_sum` by before backward (1 / the step's
                supervised tokens), which the fused loss folds into its gradient GEMMs.
            mtp_targets: [B, T] the token after next (`packing.second_next_targets`): the first MTP
                layer runs and its loss sum is returned (`mtp_loss_sum`, `mtp_num_targets`;
                `mtp_hidden_states` its head input; `num_mtp_supervised` its host count). With targets
                and gradients it is differentiated in the same backward as `loss_sum` with
                `aux.mtp_grad_scale()` (`aux_loss.attach`; the weight / the step's MTP targets).
            aux.indexer: every layer (the MTP layer too, when it runs) computes the KL of the indexer
                whose selection it attends against its own attention (`indexer_loss.py`), summed with
                its query count into `indexer_kl` ([2], over this forward's non-padding queries and
                layers); with gradients each layer's KL sum is differentiated with
                `aux.indexer_grad_scale(kl_layers)` in the main backward (None: reported only).
                `aux.indexer_warmup`: the warm-up: attention is dense (every allowed key), and with
                gradients the main model runs without them: the returned `loss_sum` is the main loss
                detached, carrying only the indexers' KL graphs.
        compute_logits: False returns only hidden states. token_logps: with targets, return
        `token_logps` (per-token fp32 log-probabilities of the targets, 0 where -100; chunked like the
        loss) instead of `loss_sum`, for losses that weigh tokens per document (preference optimization).
        """
        mb = MicroBatch(input_ids) if mb is None else mb
        aux = mb.aux
        kl = self._indexer_kl_settings(aux) if aux is not None and aux.indexer else {}
        only_indexers = kl.get("indexer_only", False)
        with torch.no_grad() if only_indexers else contextlib.nullcontext():
            if self.model.sequence_shard is None and mb.mtp_targets is None and not kl:
                hidden_BSD, inputs = self.model(input_ids, mb.position_ids, mb.document_ids, mb.longest_document,
                                                mb.single_document), None
            else:
                hidden_BSD, inputs = self.model.hidden_and_inputs(input_ids, mb.position_ids, mb.document_ids,
                                                                  mb.longest_document, mb.single_document, **kl)
            out = Glm5Output(logits=self.lm_head(hidden_BSD) if compute_logits else None, hidden_states=hidden_BSD)
            mtp_grad_scale = aux.mtp_grad_scale() if aux is not None else None
            drafted_BS = greedy_BS = None
            if mb.mtp_targets is not None:
                drafted_BS = self._mtp_loss(out, input_ids, inputs, mb.mtp_targets, loss_chunk_size,
                                            mb.num_mtp_supervised, mtp_grad_scale)
            if mb.targets is not None:
                greedy_BS = self._loss(out, mb, token_logps, loss_chunk_size, mtp_grad_scale, drafted_BS is not None)
            if drafted_BS is not None:
                if greedy_BS is None:  # no main cross-entropy ran: its greedy tokens by a head pass of their own
                    greedy_BS = chunked_greedy(out.hidden_states, self.lm_head.weight, loss_chunk_size)
                out.mtp_accepted = self.mtp_acceptance(greedy_BS, drafted_BS, self.model.local_tokens(mb.mtp_targets))
        if kl:
            out.indexer_kl = inputs.indexer_kl.stats
            if out.loss_sum is not None:  # the warm-up's KL sums: no layer output had a gradient to carry them
                out.loss_sum = inputs.indexer_kl.attach_pending(out.loss_sum)
        return out

    def _indexer_kl_settings(self, aux: AuxiliaryScales) -> dict:
        """`Glm5Model.layer_inputs`' indexer KL settings for `aux`'s indexer loss (module docstring)."""
        warmup = aux.indexer_warmup
        return dict(indexer_kl=True, indexer_grad_scale=aux.indexer_grad_scale(self.kl_layers(aux.mtp)), dense=warmup,
                    indexer_only=warmup and torch.is_grad_enabled())

    def _loss(self, out: Glm5Output, mb: MicroBatch, token_logps: bool, chunk_size: int,
              mtp_grad_scale: float | None, greedy: bool = False) -> torch.Tensor | None:
        """The loss of `mb.targets` over this forward's hidden states (or their log-probabilities), the
        MTP loss attached to it; with `greedy`, the cross-entropy's greedy tokens (`chunked_cross_entropy`)."""
        targets = self.model.local_tokens(mb.targets)
        greedy_BS = None
        if token_logps:
            out.token_logps = chunked_token_logps(out.hidden_states, self.lm_head.weight, targets, chunk_size,
                                                  mb.num_supervised)
            out.num_targets = (targets != IGNORE_INDEX).sum()
        else:
            greedy_BS = torch.empty_like(targets) if greedy else None
            out.loss_sum, out.num_targets = chunked_cross_entropy(
                out.hidden_states, self.lm_head.weight, targets, chunk_size, num_supervised=mb.num_supervised,
                grad_scale=mb.loss_scale, greedy_BS=greedy_BS)
        if mtp_grad_scale is not None and out.mtp_loss_sum is not None and out.loss_sum is not None:
            out.loss_sum = attach(out.loss_sum, out.mtp_loss_sum, mtp_grad_scale)
        return greedy_BS

    def _mtp_loss(self, out: Glm5Output, input_ids_BT, inputs: LayerInputs, mtp_targets_BT, chunk_size: int,
                  num_supervised: int | None, grad_scale: float | None) -> torch.Tensor:
        """The first MTP layer over this forward's hidden states, and its loss against `mtp_targets_BT`;
        returns its drafts (the loss's greedy tokens at the scored positions, -1 elsewhere)."""
        assert len(self.mtp) >= 1, "this model has no MTP layer"
        layer_args = (out.hidden_states, self.model.next_token_embeds(input_ids_BT), inputs.cos, inputs.sin,
                      inputs.allowed_BST, inputs.plain_causal, inputs.sparse_needed, inputs.shard)
        kl = inputs.indexer_kl
        if kl is None:
            mtp_BSD = self.mtp[0](*layer_args)
        else:  # the MTP layer's indexer learns with the others
            with kl.grad_context():
                mtp_BSD, kl_stats = self.mtp[0](*layer_args, indexer_kl=kl.request)
            mtp_BSD = kl.collect(mtp_BSD, kl_stats)
        out.mtp_hidden_states = mtp_BSD
        local_targets_BS = self.model.local_tokens(mtp_targets_BT)
        drafted_BS = torch.empty_like(local_targets_BS)
        out.mtp_loss_sum, out.mtp_num_targets = chunked_cross_entropy(
            mtp_BSD, self.lm_head.weight, local_targets_BS, chunk_size,
            num_supervised=num_supervised, grad_scale=grad_scale, greedy_BS=drafted_BS)
        return drafted_BS

    @torch.no_grad()
    def mtp_acceptance(self, greedy_BS, drafted_BS, local_targets_BS) -> torch.Tensor:
        """(accepted, positions) fp32 [2] over the positions t with an MTP target whose t+1 has a greedy
        token (`Glm5Output.mtp_accepted`): `greedy_BS` the main model's greedy tokens (-1 where unknown:
        a position its loss does not supervise), `drafted_BS` the MTP layer's, both taken from the
        losses' own logits (`chunked_cross_entropy`'s `greedy_BS`: no extra head pass). The main model's
        are gathered over the full rows first (under context parallelism position t+1 may be another
        rank's)."""
        shard = self.model.sequence_shard
        greedy_BT = greedy_BS if shard is None else shard.gather(greedy_BS.unsqueeze(-1)).squeeze(-1)
        next_greedy_BS = self.model.local_tokens(torch.cat([greedy_BT[:, 1:], greedy_BT[:, -1:]], dim=1))
        scored_BS = (local_targets_BS != IGNORE_INDEX) & (next_greedy_BS >= 0)
        accepted = ((drafted_BS == next_greedy_BS) & scored_BS).sum()
        return torch.stack([accepted, scored_BS.sum()]).float()

    def kl_layers(self, mtp: bool) -> int:
        """The layers computing an indexer KL when the indexers' loss trains, the loss's unit per query:
        every decoder layer, and the first MTP layer when it runs (`mtp`)."""
        return self.args.num_hidden_layers + (1 if mtp else 0)

    def freeze_untrained_by_default(self) -> None:
        """Indexers get no gradient in transformers (no indexer loss) and MTP layers run only
        when their loss is asked for: mark them frozen so optimizers hold no state for them
        (`set_trainable_extras` unfreezes them for a run that trains them)."""
        self.set_trainable_extras(mtp=False, indexer=False)

    def set_trainable_extras(self, mtp: bool, indexer: bool) -> None:
        """Whether the MTP layers (but their indexers) and the DSA indexers (the MTP layers'
        included) train: before sharding and before an optimizer is built."""
        for name, param in self.named_parameters():
            if ".indexer." in name:
                param.requires_grad_(indexer)
            elif name.startswith("mtp."):
                param.requires_grad_(mtp)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init as transformers does (normal(0, initializer_range), ones for norms)."""
        generator_ctx = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
        with generator_ctx:
            if seed is not None:
                torch.manual_seed(seed)
            std = self.args.initializer_range
            nn.init.normal_(self.model.embed_tokens.weight, mean=0.0, std=std)
            if self.model.padding_idx is not None:
                self.model.embed_tokens.weight[self.model.padding_idx].zero_()
            for layer in self.model.layers:
                layer.reset_parameters(std)
            self.model.norm.reset_parameters()
            if not self.args.tie_word_embeddings:
                nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)
            for layer in self.mtp:
                layer.reset_parameters(std)
            self.model.rotary_emb.reset_parameters()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    args: Glm5Args,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
    moe_backend: str = "grouped_mm",
    init: bool = True,
    seed: int | None = None,
    indexer_backend: str = "auto",
    fp8_base: str | None = None,
) -> Glm5ForCausalLM:
    """Construct on the meta device, then materialize on `device` in `dtype`.

    The router weight and its correction bias stay fp32. With `device="meta"` no
    memory is allocated (for inspection, planning and the sharded load). `fp8_base` (an FP8
    matmul backend) makes the base frozen FP8 on the meta device first (`fp8_base.py`): the
    one path for every FP8 base, whose e4m3 weights and block scales a loader then fills.
    """
    with torch.device("meta"), default_dtype(dtype):
        model = Glm5ForCausalLM(args, attention_backend, moe_backend, indexer_backend)
    if fp8_base is not None:
        assert not init or str(device) == "meta", "an FP8 base is loaded, never initialized"
        convert_to_fp8_base(model, fp8_base)
    if str(device) == "meta":
        return model
    model.to_empty(device=device)
    if init:
        model.init_weights(seed)
    else:
        model.model.rotary_emb.reset_parameters()
    return model
