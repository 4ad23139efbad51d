"""Pipeline stages of a GLM-5: consecutive decoder layers as modules of their own, in plain PyTorch.

A stage runs layers [first, last) of a `Glm5ForCausalLM` and shares the model's own
modules (no copy: the parameters a stage trains are the model's, under the model's
names). The first stage also embeds the tokens; the last also applies the final norm,
the LM head and the loss, and, when the multi-token-prediction loss trains (`mtp`), the
first MTP layer and its loss.

    stage 0:        ids [B, T]              -> h [B, S, D] (+ e) (+ carried selection)
    stage i:        h (+ e) (+ carried selection) -> h (+ e) (+ carried selection)
    last stage:     h (+ e) (+ carried selection) -> loss_sum x loss_scale   ([1])

The last stage's loss is the summed cross-entropy of the targets, or, when the queued microbatch
carries a `token_loss` (another objective: preference pairs), that function of its rows and their
targets' log-probabilities. A distillation run's stages (`distill`) add the teacher's KL term
(models/common/distill_loss.py) to the cross-entropy, and report both parts in `statistics`.

The MTP layer at position t reads the embedding of token t + 1 (`model.py`), and the embedding
lives on the first stage. With `mtp` the first stage embeds the next tokens too
(`Glm5Model.next_token_embeds`, the one-process lookup) and that activation `e` [B, S, D]
travels beside the hidden states through every stage (a stage in between passes a copy of it
on), and its gradient travels back the same way, into the embedding's: exact, and the schedule
keeps it in order with everything else. Cost: a second activation of the hidden states' size at
every stage boundary, B x S x D x the compute dtype's bytes per microbatch forward (bf16 GLM-5,
D 6144: 12 KiB per token) and the same again backward, doubling the pipeline's point-to-point
traffic, and as much memory per microbatch in flight on a stage (twice on one in between); the
alternative, a copy of the 154880 x 6144 embedding on the last stage, would cost its weights,
their optimizer state and a gradient all-reduce every step. The MTP layer is then part of the last stage's module tree (an FSDP2 unit under the
stage's root: gathered, and its gradients reduced, with the stage's); without `mtp` the MTP
layers stay outside every stage: never run, they must not be units of a stage's FSDP tree,
whose no-sync microbatches touch every unit's gradients. Its loss is attached to the main
loss's backward with the microbatch's MTP factor (`mb.aux`, `models/common/aux_loss.py`); its
(sum, count) and its acceptance's (`Glm5ForCausalLM.mtp_acceptance`) are kept in `statistics`.

With the indexers' KL loss (`indexer_kl`, `indexer_loss.py`) every stage's layers compute their KL
and `run_layers` attaches each to its layer's output with the microbatch's indexer factor (`mb.aux`:
the one-process factor, weight / (the step's queries x the model's KL layers)), so the schedule's
backward through a stage differentiates its own layers' KL; the last stage's MTP layer adds its own.
Each stage adds its layers' fp64 (KL sum, counted queries x layers) to `statistics["indexer_kl"]`:
summed over the stages, one process's. The selection's graph (a shared-indexer layer's KL trains
the indexer of the full layer it reuses) never crosses a stage: stages start on full-indexer layers
(`parallelize.split_model`). The warm-up (dense attention, the main model without gradients) does not
run here: a stage's output would carry no graph back to the stages before it.

What every stage needs of a microbatch besides the activations (positions, documents, targets,
and the facts counted on the host that pick the attention path and size the loss without a host
sync: longest document, one-document rows, supervised targets; the loss factors) is its rows, a
`MicroBatch` on the stage's device, queued by the caller in `microbatches` (`StageMicrobatch`),
one entry per microbatch in the order the schedule runs them (every schedule runs a stage's
forwards in microbatch order); only the activations travel between stages.

Shared-indexer layers (GLM-5.2/5.3 IndexShare) reuse the top-k selection of the
latest full-indexer layer. When a stage starts on such a layer, the previous stage
hands that selection on: the [B, S, T] mask as uint8 (what every transport carries)
and one flag, "selects every allowed key" (then the mask is the allowed mask itself).
By default they are extra outputs / inputs of the stages, after the activations; a caller
that moves them itself (a pipeline schedule only moves tensors that can carry a gradient) sets
`send_selection` / `receive_selection`, and the stages then pass activations only.

A stage implements the stage interface `glmtune/distributed/pipeline.py` documents
(`is_first`, `is_last`, `num_activations`, `carry_in`, `carry_out`, `send_selection`,
`receive_selection`, `microbatches`, `loss_sums`, `statistics`, `local_tokens`). The model
knows nothing of parallelism: which stages exist, on which rank, and how their activations move
is the pipeline's business; the split itself is the plan's (`parallelize.split_model`).

Legend: B rows in a microbatch, S queries on this rank, T tokens of a row, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.models.common.aux_loss import attach
from glmtune.models.common.distill_loss import distilling, with_teacher_kl
from glmtune.models.common.loss import chunked_cross_entropy, chunked_greedy, chunked_token_logps
from glmtune.models.common.microbatch import MicroBatch, StageMicrobatch
from glmtune.models.glm5.model import Glm5ForCausalLM, LayerInputs
from glmtune.models.glm5.moe import MoE


def decoder_layers(model: Glm5ForCausalLM) -> list[nn.Module]:
    """The decoder layers this process holds, in order: all of them, or a pipeline rank's own."""
    layers = model.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def needs_carry(indexer_types: list[str], first_layer: int) -> bool:
    """Whether a stage starting at `first_layer` needs the previous stage's top-k selection."""
    return 0 < first_layer < len(indexer_types) and indexer_types[first_layer] == "shared"


class Glm5Stage(nn.Module):
    """Layers `layer_ids` (consecutive) of `model`, and the embedding / head when first / last.

    Args:
        model: the full model (its modules are shared, not copied).
        layer_ids: the decoder layers of this stage, e.g. range(0, 20).
        is_first / is_last: whether the stage embeds the tokens / computes the loss.
        loss_chunk_size: tokens per slice of the chunked cross-entropy (last stage).
        mtp: the multi-token-prediction loss trains: the next tokens' embeddings travel with the
            hidden states and the last stage runs the first MTP layer (module docstring).
        indexer_kl: the indexers' KL loss trains: every layer computes its KL (module docstring).
    """

    def __init__(self, model: Glm5ForCausalLM, layer_ids: range, is_first: bool, is_last: bool,
                 loss_chunk_size: int = 2048, mtp: bool = False, indexer_kl: bool = False,
                 distill: bool = False) -> None:
        super().__init__()
        assert len(layer_ids) > 0 and layer_ids.step == 1, layer_ids
        core = model.model
        self.layer_ids = layer_ids
        self.is_first, self.is_last = is_first, is_last
        self.carry_in = needs_carry(model.args.indexer_types, layer_ids.start)
        self.carry_out = not is_last and needs_carry(model.args.indexer_types, layer_ids.stop)
        self.loss_chunk_size = loss_chunk_size
        self.core = [core]  # a list: the shared model core must not be registered as a submodule
        self.causal_lm = [model]  # the same: its MTP acceptance reads the head (last stage)
        self.layers = nn.ModuleDict({str(i): core.layers[i] for i in layer_ids})
        self.rotary_emb = core.rotary_emb
        if is_first:
            self.embed_tokens = core.embed_tokens
        if is_last:
            self.norm = core.norm
            self.lm_head = model.lm_head
        # Hidden states, and with the MTP loss the next tokens' embeddings: [B, S, D] each.
        self.mtp = mtp
        self.num_activations = 2 if mtp else 1
        if mtp and is_last:  # in the stage's tree only when it runs (module docstring)
            self.mtp_layer = model.mtp[0]
        self.loss_sums: list[torch.Tensor] = []  # unscaled loss sums of the microbatches, for logging
        # (sum, count) of the auxiliary losses over the microbatches since the caller last cleared
        # them, added by the last stage (the indexer KL: by every stage); every stage names the same
        # ones (each rank reduces them).
        self.indexer_kl = indexer_kl
        self.statistic_names = (*(("mtp_loss", "mtp_acceptance") if mtp else ()),
                                *(("indexer_kl",) if indexer_kl else ()), *(("ce", "kl") if distill else ()))
        self.statistics: dict[str, torch.Tensor] = {}
        # Tokens routed to each expert, summed over the training microbatches since the caller
        # last cleared it (read right after the layers ran: a recompute in backward overwrites
        # the MoE's own record).
        self.moe = [(f"model.layers.{i}.mlp", core.layers[i].mlp) for i in layer_ids
                    if isinstance(core.layers[i].mlp, MoE)]
        self.expert_load: dict[str, torch.Tensor] = {}
        self.microbatches: list[StageMicrobatch] = []
        # The layers computing an indexer KL over the whole model, as one process counts them.
        self.kl_layers = model.kl_layers(mtp)
        # (mask uint8 [B, S, T], flag uint8 [1]) -> None, and () -> the same pair: see the module docstring
        self.send_selection = None
        self.receive_selection = None
        self.backward_twice = False  # set by the pipeline under a zero-bubble schedule

    def local_tokens(self, t_BT: torch.Tensor) -> torch.Tensor:
        """This process's tokens of a per-token tensor of the full rows ([B, T, ...] -> [B, S, ...]);
        itself without context parallelism."""
        return self.core[0].local_tokens(t_BT)

    @property
    def sequence_shard(self):
        """The model's context-parallel shard (None: every query is local), for losses over whole rows."""
        return self.core[0].sequence_shard

    def forward(self, x, *received):
        """One microbatch through this stage.

        Args:
            x: token ids [B, T] on the first stage, hidden states [B, S, D] after it.
            received: after the first stage, the next tokens' embeddings [B, S, D] (with `mtp`),
                then the previous stage's selection (uint8 [B, S, T] and uint8 [1]) when this stage
                starts on a shared-indexer layer and no `receive_selection` is set.
        The next entry of `microbatches` is this microbatch: its rows (positions and documents of
        the full rows [B, T], the targets [B, T] the last stage reads, the MTP targets with `mtp`)
        and their host facts.
        """
        assert self.microbatches, "queue the microbatch's rows before running the stage"
        queued = self.microbatches.pop(0)
        mb = queued.rows
        core = self.core[0]
        received = list(received)
        if self.is_first:
            h_BSD = self.embed_tokens(self.local_tokens(x))  # the query slice under context parallelism
            next_BSD = core.next_token_embeds(x) if self.mtp else None
        else:
            h_BSD, next_BSD = x, received.pop(0) if self.mtp else None
        batch, seq_len = mb.position_ids.shape
        kl_scale = mb.aux.indexer_grad_scale(self.kl_layers) if mb.aux is not None else None
        inputs = core.layer_inputs(batch, seq_len, h_BSD.device, h_BSD.dtype, mb.position_ids, mb.document_ids,
                                   mb.longest_document, mb.single_document, indexer_kl=self.indexer_kl,
                                   indexer_grad_scale=kl_scale, dense=False)
        selection = None
        if self.carry_in:
            carried_mask, carried_all = received if self.receive_selection is None else self.receive_selection()
            selection = (carried_mask.bool(), bool(carried_all.item()))
        h_BSD, selection = core.run_layers(self.layers.values(), h_BSD, inputs, selection)
        if torch.is_grad_enabled():
            for name, moe in self.moe:
                self.expert_load[name] = self.expert_load.get(name, 0) + moe.tokens_per_expert
        if self.is_last:
            loss = self._loss(h_BSD, next_BSD, inputs, queued)
            self._add_indexer_kl(inputs)  # after the MTP layer's
            return loss
        self._add_indexer_kl(inputs)
        # A copy when the last layer's KL is attached to it (`aux_loss.attach` returns a view): split-
        # backward schedules (ZBVZeroBubble) detach a stage's outputs in place, which a view refuses.
        outputs = [h_BSD.clone() if h_BSD._is_view() else h_BSD]
        if next_BSD is not None:
            # Passed on as a copy: the received tensor itself is the schedule's receive buffer (a
            # leaf), and zero-bubble schedules detach their outputs in place, which a view refuses.
            outputs.append(next_BSD if self.is_first else next_BSD.clone())
        if self.carry_out:
            mask_BST, every = selection
            carried = (mask_BST.to(torch.uint8), torch.tensor([int(every)], dtype=torch.uint8, device=h_BSD.device))
            if self.send_selection is None:
                outputs += carried
            else:
                self.send_selection(*carried)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _add_statistic(self, name: str, pair: torch.Tensor) -> None:
        self.statistics[name] = self.statistics[name] + pair if name in self.statistics else pair

    def _add_indexer_kl(self, inputs: LayerInputs) -> None:
        """This microbatch's KL (sum, counted queries x layers) of the stage's layers (fp64 [2])."""
        if inputs.indexer_kl is not None:
            self._add_statistic("indexer_kl", inputs.indexer_kl.stats)

    def _loss(self, h_BSD, next_BSD, inputs: LayerInputs, queued: StageMicrobatch):
        """The last stage's loss of the microbatch: its sum x `mb.loss_scale`, as a [1] tensor."""
        mb, local = queued.rows, self.local_tokens
        hidden_BSD = self.norm(h_BSD)
        greedy_BS = None  # the main loss's greedy tokens, which the MTP acceptance compares drafts with
        if queued.token_loss is not None:  # another objective: a function of the targets' log-probabilities
            loss_sum = queued.token_loss(mb, chunked_token_logps(hidden_BSD, self.lm_head.weight, local(mb.targets),
                                                                 self.loss_chunk_size, mb.num_supervised))
        else:
            greedy_BS = torch.empty_like(local(mb.targets)) if self.mtp else None
            loss_sum, _ = chunked_cross_entropy(hidden_BSD, self.lm_head.weight, local(mb.targets),
                                                self.loss_chunk_size, num_supervised=mb.num_supervised,
                                                grad_scale=mb.loss_scale,
                                                backward_twice=self.backward_twice, greedy_BS=greedy_BS)
        if distilling(mb.teacher):  # the teacher's KL term, added before the loss is scaled (as Glm5Compute.loss)
            loss_sum, parts = with_teacher_kl(loss_sum, hidden_BSD, self.lm_head.weight, mb.teacher.local(local),
                                              mb.num_supervised)
            for name, pair in parts.items():  # (sum, supervised targets): the trainer's per-token mean
                self._add_statistic(name, pair)
        self.loss_sums.append(loss_sum.detach())
        if self.mtp:
            if greedy_BS is None:  # no cross-entropy ran: the greedy tokens by a head pass of their own
                greedy_BS = chunked_greedy(hidden_BSD, self.lm_head.weight, self.loss_chunk_size)
            loss_sum = self._attach_mtp_loss(loss_sum, hidden_BSD, next_BSD, inputs, mb, greedy_BS)
        scaled = loss_sum * mb.loss_scale if mb.loss_scale is not None else loss_sum
        return scaled.reshape(1)  # [1]: the schedule concatenates the microbatches' outputs

    def _attach_mtp_loss(self, loss_sum, hidden_BSD, next_BSD, inputs: LayerInputs, mb: MicroBatch,
                         greedy_BS: torch.Tensor) -> torch.Tensor:
        """The first MTP layer over the final-normed hidden states (as `Glm5ForCausalLM.forward` runs
        it), its loss attached to `loss_sum`'s backward with the microbatch's MTP factor; (sum, count)
        of the loss and of its acceptance against the main model's greedy tokens `greedy_BS` added to
        `statistics`."""
        layer_args = (hidden_BSD, next_BSD, inputs.cos, inputs.sin, inputs.allowed_BST, inputs.plain_causal,
                      inputs.sparse_needed, inputs.shard)
        kl = inputs.indexer_kl
        if kl is None:
            mtp_BSD = self.mtp_layer(*layer_args)
        else:  # the MTP layer's indexer learns with the others (`Glm5ForCausalLM._mtp_loss`)
            with kl.grad_context():
                mtp_BSD, kl_stats = self.mtp_layer(*layer_args, indexer_kl=kl.request)
            mtp_BSD = kl.collect(mtp_BSD, kl_stats)
        local_targets_BS = self.local_tokens(mb.mtp_targets)
        grad_scale = mb.aux.mtp_grad_scale() if mb.aux is not None else None
        drafted_BS = torch.empty_like(local_targets_BS)
        mtp_sum, count = chunked_cross_entropy(mtp_BSD, self.lm_head.weight, local_targets_BS,
                                               self.loss_chunk_size, num_supervised=mb.num_mtp_supervised,
                                               grad_scale=grad_scale, backward_twice=self.backward_twice,
                                               greedy_BS=drafted_BS)
        accepted = self.causal_lm[0].mtp_acceptance(greedy_BS, drafted_BS, local_targets_BS)
        for name, pair in (("mtp_loss", torch.stack([mtp_sum.detach().float(), count.float()])),
                           ("mtp_acceptance", accepted)):
            self._add_statistic(name, pair)
        if grad_scale is None:  # forward only
            return loss_sum
        return attach(loss_sum, mtp_sum, grad_scale)


def split_into_stages(model: Glm5ForCausalLM, layers_per_stage: list[int], stage_ids: list[int],
                      loss_chunk_size: int = 2048, mtp: bool = False, indexer_kl: bool = False,
                      distill: bool = False) -> list[Glm5Stage]:
    """This process's stages (`stage_ids`, in order) of the split `layers_per_stage`, and the
    model pruned to them: layers, embedding, norm, head and MTP of other stages are removed,
    so its state dict names exactly what this process holds, under the full model's names
    (`model.layers.{i}` keeps its index: the decoder layers become a ModuleDict). `mtp`: the
    last stage runs the first MTP layer and its loss; `indexer_kl`: every layer computes its indexer's
    KL; `distill`: the last stage adds a teacher's KL term (`Glm5Stage`)."""
    assert sum(layers_per_stage) == model.args.num_hidden_layers, layers_per_stage
    assert not mtp or len(model.mtp) > 0, "the MTP loss needs a model with an MTP layer"
    starts = [sum(layers_per_stage[:i]) for i in range(len(layers_per_stage))]
    last = len(layers_per_stage) - 1
    stages = [Glm5Stage(model, range(starts[i], starts[i] + layers_per_stage[i]), i == 0, i == last,
                        loss_chunk_size, mtp, indexer_kl, distill) for i in stage_ids]
    kept = {i for stage in stages for i in stage.layer_ids}
    core = model.model
    core.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(core.layers) if i in kept})
    if 0 not in stage_ids:
        core.embed_tokens = None
    if last not in stage_ids:
        core.norm = None
        model.lm_head = None
        model.mtp = nn.ModuleList()
    return stages
