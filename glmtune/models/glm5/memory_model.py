"""`GLM5_MEMORY`: GLM-5's answers to `glmtune plan`'s memory questions (models/common/memory_model.py).

Per decoder layer, from memory_activations.py's formulas: what autograd keeps under
`parallel.activation_checkpointing` and what the layer's backward recomputes ("full" keeps each
layer's input and recomputes the rest; "selective" also keeps the top-k mask, the attention
outputs and log-sum-exp, and every matmul output whose reduction dim is at least
`parallel.ac_keep_matmul_min_k`, which the recompute then does not bring back), and its
backward's scratch. Beside the layers:

  masks            the allowed-keys mask, bool [q, k], one per micro-batch in flight (each stage's
                   forward builds its own, kept by the checkpointed layers), unless every row is
                   one document no longer than the indexer's top-k
  stage boundary   the hidden states [q, D] that cross every pipeline stage boundary, and with the
                   MTP loss the next tokens' embeddings beside them (plan/memory.py counts torch's
                   receive buffers and the stages' outputs from them)
  loss             the last stage's final norm and the fused loss's hidden rows and their gradient;
                   the forward's largest scratch is a [2048, V] logits slice in bf16 + fp32, or the
                   indexer's score chunk, whichever is larger
  MoE transients   under expert parallelism the all-to-all's send buffer (this rank's token-expert
                   pairs at balanced routing, [q K, D]); an FP8 frozen base's largest projection
                   dequantized to bf16 (one at a time), in forward and in each MoE layer's backward
  MTP              with `train.mtp_loss_weight` > 0 the last stage's MTP layer, sized as the
                   deepest MoE layer with an indexer (the MTP layer is one), its [enorm(e);
                   hnorm(h)] input rows, its loss rows and the head weight gradient its own fused
                   loss computes in forward; during its backward (run first) the layer's recompute

Parameter names: decoder layer i is `model.layers.{i}.`, the MTP layers `mtp.{j}.`, the
embedding `model.embed_tokens`; routed experts live under `.mlp.experts.`.
"""

from __future__ import annotations

from glmtune.models.common.memory_model import LayerMemory, MemoryModel, StepShape, StepTerms
from glmtune.models.glm5 import memory_activations as act
from glmtune.models.glm5.args import Glm5Args

_EXPERTS = ".mlp.experts."
LOSS_SLICE = 2048  # tokens per slice of the fused loss's logits


def _trainability(step: StepShape) -> act.Trainability:
    return act.Trainability.of(step.lora_rank)


def layer_activations(args: Glm5Args, step: StepShape, index: int) -> tuple[int, int]:
    """(kept, recomputed) bytes of decoder layer `index` under the step's checkpointing."""
    e, ac = step.compute_bytes, step.activation_checkpointing
    saved = sum(act.layer_saved(args, step, index, e, _trainability(step)).values())
    layer_input = e * step.queries * args.hidden_size
    if ac == "full":
        kept = layer_input + kept_exchange_rows(args, step, index)
    elif ac == "selective":
        kept = act.selective_kept(args, step, index, e, step.ac_keep_matmul_min_k)
    else:
        kept = saved
    # A checkpointed layer's backward runs its forward again: everything it saves comes back,
    # but what selective checkpointing kept (beyond the layer input) is not recomputed.
    recompute = 0 if ac == "none" else saved - (kept - layer_input)
    return kept, recompute


def kept_exchange_rows(args: Glm5Args, step: StepShape, index: int) -> int:
    """The rows an expert-parallel MoE layer's forward keeps for its recomputation
    (`parallel.ep_keep_exchanges`): per kept exchange, this rank's token-expert pairs at balanced
    routing (the combine's rows come back to the rank that routed them; the dispatch's, as many,
    to the experts' rank)."""
    if not step.kept_exchanges or step.ep <= 1 or args.mlp_layer_types[index] != "sparse":
        return 0
    return step.kept_exchanges * step.compute_bytes * step.queries * args.num_experts_per_tok * args.hidden_size


def moe_transients(args: Glm5Args, step: StepShape) -> dict[str, int]:
    """What an MoE layer holds for a moment: EP's send buffer, an FP8 projection dequantized."""
    if step.fp8_base and not step.fp8_in_gemm:  # each FP8 projection is dequantized into a transient bf16 weight
        local_experts = args.n_routed_experts // step.ep
        dequantized = {"FP8 weight dequantized (largest projection)":
                       2 * local_experts * 2 * args.moe_intermediate_size * args.hidden_size}
    else:
        dequantized = {}
    # Expert parallelism: the all-to-all's send buffer beside the received rows (which the saved
    # activations count), at balanced routing: this rank's token-expert pairs, one direction at a time.
    all_to_all = {"MoE all-to-all buffer": step.compute_bytes * step.queries * args.num_experts_per_tok
                  * args.hidden_size} if step.ep > 1 and "sparse" in args.mlp_layer_types else {}
    return {**all_to_all, **dequantized}


class Glm5MemoryModel(MemoryModel):
    """GLM-5's memory model (module docstring)."""

    def layer(self, args: Glm5Args, step: StepShape, index: int) -> LayerMemory:
        kept, recomputed = layer_activations(args, step, index)
        transients = moe_transients(args, step) if args.mlp_layer_types[index] == "sparse" else {}
        # The all-to-all's send buffer lives in the MoE's part of the backward (its recomputed dispatch
        # and its combine's and dispatch's gradients), beside the MLP's scratch and not the attention's.
        all_to_all = transients.pop("MoE all-to-all buffer", 0)
        scratch = act.backward_transient(args, step, index, step.compute_bytes, _trainability(step),
                                         step.score_buffer_bytes, all_to_all)
        # A shared-indexer layer reads the selection, bool [B, S, T] (indexer.py's dsa_topk_mask), of the
        # full-indexer layer before it and keeps it as an input until its backward; the shared layers
        # after it read the same tensor. (Handed to every layer, as it was until 2026-12-07, the
        # selections held 0.69 GiB on sft_4k rank 64 at its peak and 4.62 on sft_32k_cp8's rank 384.)
        plain_causal = step.one_document and step.seq <= args.index_topk
        reads_new = index and args.indexer_types[index] == "shared" and args.indexer_types[index - 1] == "full"
        selection = act.BOOL * step.queries * step.keys if reads_new and not plain_causal else 0
        return LayerMemory(kept, recomputed, scratch, transients, selection)

    def step_terms(self, args: Glm5Args, step: StepShape, layers: list[int], last: bool) -> StepTerms:
        e, q, d = step.compute_bytes, step.queries, args.hidden_size
        plain_causal = step.one_document and step.seq <= args.index_topk
        loss = {}
        if last:
            loss["final norm"] = act.norm_saved(q, d, e, _trainability(step).norms, step.fused_norms)
            loss["loss: hidden rows and their gradient"] = 2 * e * q * d
        logits_slice = min(LOSS_SLICE, q) * args.vocab_size * (e + act.F32) if last else 0
        indexer_scratch = max((act.indexer_transient(args, step, e) for i in layers if args.indexer_types[i] == "full"),
                              default=0)
        # Each stage's forward builds its micro-batch's allowed mask [B, S, T]; the checkpointed layers
        # keep it as an input until that micro-batch's backward: one per micro-batch in flight.
        mask = {} if plain_causal else {"attention masks (one per micro-batch in flight)": act.BOOL * q * step.keys}
        # The hidden states [B, S, D] cross every stage boundary, and with the MTP loss the next tokens'
        # embeddings beside them (stages.py): plan/memory.py counts their receive buffers and the
        # stages' copies of them. A chunk in flight on a non-first stage keeps its received hidden
        # states as its first layer's input (`received_kept`): the buffer itself, counted once.
        rows = e * q * d
        return StepTerms(fixed={}, loss=loss, forward_scratch=max(logits_slice, indexer_scratch),
                         transients=moe_transients(args, step), head_elements=args.vocab_size * d,
                         per_microbatch=mask, boundary=(rows, rows) if step.mtp else (rows,), received_kept=rows)

    def auxiliary(self, args: Glm5Args, step: StepShape, head_grad: int) -> tuple[dict[str, int], dict[str, int]]:
        """The MTP loss's memory on the last stage (module docstring)."""
        if not step.mtp or not args.num_nextn_predict_layers:
            return {}, {}
        like = max(i for i in range(args.num_hidden_layers)
                   if args.mlp_layer_types[i] == "sparse" and args.indexer_types[i] == "full")
        kept, recompute = layer_activations(args, step, like)
        rows = step.compute_bytes * step.queries * args.hidden_size
        saved = {"MTP layer: activations (saved)": kept + 2 * rows, "MTP loss: hidden rows and their gradient":
                 2 * rows, "MTP head weight gradient (its fused loss)": head_grad}
        return saved, {"MTP layer: saved + recomputed": kept + recompute + 2 * rows,
                       "MTP head weight gradient (its fused loss)": head_grad}

    def auxiliary_held(self, args: Glm5Args, step: StepShape, head_grad: int) -> dict[str, int]:
        """The MTP loss's fused head computes its own [V, D] weight gradient in forward, as the main loss
        does: on sft_4k's last pipeline rank both are live at the peak (3.54 GiB from the fused loss, 1.77
        without MTP: docs/plan.md)."""
        return {"MTP head weight gradient (its fused loss)": head_grad} \
            if step.mtp and args.num_nextn_predict_layers else {}

    def auxiliary_units(self, step: StepShape) -> tuple[str, ...]:
        return ("mtp.0",) if step.mtp else ()

    def unit_of(self, name: str) -> str:
        """`layer.{i}`, `mtp.{j}`, or the root's `embed` / `head` (final norm and LM head; the root's
        two ends are gathered at different times)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            return f"layer.{int(parts[2])}"
        if name.startswith("mtp."):
            return "mtp." + parts[1]
        return "embed" if name.startswith("model.embed_tokens") else "head"

    def routed_expert(self, name: str) -> bool:
        return _EXPERTS in f"{name}."

    def weight_std(self, args: Glm5Args) -> float:
        return args.initializer_range


GLM5_MEMORY = Glm5MemoryModel()
