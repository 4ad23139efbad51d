"""Peak memory of one rank through a training step: model state, activations and transients.

A step is walked phase by phase and the largest total is the planned peak (what
`torch.cuda.max_memory_allocated` measures; the CUDA context, NCCL buffers and the
allocator's fragmentation are the separate headroom line of the plan):
  forward end     parameters + optimizer state (+ gradients already accumulated by earlier
                  micro-batches) + the saved activations of every in-flight micro-batch +
                  the masks and loss buffers (the fused loss computes the head's weight
                  gradient and the hidden-state gradient during forward) + the largest
                  forward scratch (indexer chunk, one slice of logits)
  layer l backward  the activations of layers before l, layer l's own (recomputed under
                  activation checkpointing) and its backward scratch, the gradients
                  finished so far, and under FSDP2 this unit's and the next unit's gathered
                  parameters, its unsharded gradients and the reduce-scatter's staging copy
                  in the reduce dtype (fp32)
  root reduction, optimizer step: every gradient, plus under FSDP2 the root unit's
                  (embedding, head) unsharded gradients and their fp32 staging
An FP8 frozen base adds its largest projection dequantized to bf16 (one at a time).
Under expert parallelism the all-to-all's send buffer (this rank's token-expert pairs at
balanced routing, [q K, D]) is added in forward and in every MoE layer's backward.

Activation bytes per layer come from `activations.py`. Pipeline schedules keep several
micro-batches in flight on a rank: 1F1B's warm-up holds pp - r of them on pp rank r, the
interleaved and zero-bubble schedules (v stages per rank) (v - 1) pp + 2 (pp - 1 - r) + 1
stage-chunks, GPipe all of them; rank 0 holds the most. A stage's units stay gathered from
their first forward to their last microbatch's backward, and reduce their gradients then: a
step's first backward finds no gradient of this step yet (measured on one H200 with `glmtune
plan --measure`, 2026-12-03: counting every gradient from the first backward put the first
stage of recipes/glm5/sft_4k.yaml 14% above its measured peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmtune.config import JobConfig
from glmtune.config.degrees import MeshDegrees
from glmtune.config.validate import grad_accum_steps, pipeline_microbatches
from glmtune.distributed.mesh import ParallelMesh
from glmtune.plan import activations as act
from glmtune.plan.model_state import StateBytes, layer_stages
from glmtune.train.precision import resolve_precision

GIB = 2**30


@dataclass
class Phase:
    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    """The planned peak of one rank and how it is made up."""

    rank: int
    state: StateBytes
    peak: Phase
    phases: list[Phase]
    activations_per_layer: dict[int, int]  # saved bytes per micro-batch, by layer, as kept

    def to_dict(self) -> dict:
        return {"rank": self.rank, "peak_bytes": self.peak.total, "peak_phase": self.peak.name,
                "peak_parts": self.peak.parts, "state": self.state.to_dict(),
                "phases": {p.name: p.total for p in self.phases},
                "activations_per_layer": self.activations_per_layer}


def in_flight(cfg: JobConfig, degrees: MeshDegrees, pp_rank: int) -> int:
    """Stage-chunks of activations pp rank `pp_rank` holds at once (module docstring)."""
    p = cfg.parallel
    if degrees.pp == 1:
        return 1

    microbatches = pipeline_microbatches(cfg)
    v = p.pp_stages_per_rank
    if p.pp_schedule == "GPipe":
        return microbatches * v
    if v == 1:
        return min(microbatches, degrees.pp - pp_rank)
    return min(microbatches * v, (v - 1) * degrees.pp + 2 * (degrees.pp - 1 - pp_rank) + 1)


def _compute_size(cfg: JobConfig) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4


def plan_rank_memory(model, cfg: JobConfig, degrees: MeshDegrees, rank: int, state: StateBytes,
                     one_document: bool = True) -> MemoryPlan:
    """The phases of one step on global rank `rank` holding `state` (module docstring)."""
    args = model.args
    e = _compute_size(cfg)
    p = cfg.parallel
    precision = resolve_precision(cfg)
    fsdp = degrees.fsdp_applies()
    mesh = ParallelMesh(degrees, rank=rank)
    pp_rank = mesh.rank("pp")
    stage, stages_of_rank = layer_stages(model, cfg, degrees)
    mine = stages_of_rank[pp_rank]
    layers = [i for i in range(args.num_hidden_layers) if stage[i] in mine]
    last_stage = max(max(s) for s in stages_of_rank)
    last = last_stage in mine

    rows = cfg.train.micro_batch_size
    if degrees.pp > 1:
        rows = max(1, rows // pipeline_microbatches(cfg))
    mb = act.MicroBatch(rows, cfg.data.packed_sequence_size, degrees.cp, one_document)
    train = act.Trainability.of(cfg.peft.rank if cfg.peft.method == "lora" else 0)
    score_buffer = cfg.model.attention_score_buffer_mib << 20

    kept, recompute = _layer_activations(args, mb, layers, e, train, p)
    chunks = in_flight(cfg, degrees, pp_rank)
    stages_here = max(1, len(mine))
    # Other in-flight stage-chunks hold about the rank's average stage of layers each.
    other_chunks = (chunks - 1) * sum(kept.values()) // stages_here

    static = {"parameters": state.params, "optimizer state": state.optimizer}
    grads_all = state.grads
    # Gradients of an earlier micro-batch of the step are held only when the trainer accumulates
    # micro-batches. A pipeline's microbatches do not: each unit reduces its gradient once, after
    # its last microbatch's backward, and the step's first backward finds none (zero_grad frees them).
    accumulating = _accumulation_steps(cfg, degrees) > 1
    units = state.units
    gathered_root = 0
    kept_layers: dict[int, int] = {}  # layer -> its unit's gathered bytes, kept until its backward ends
    if fsdp:  # the root unit (embedding, final norm, head) stays gathered between forward and backward
        gathered_root = sum(units[u].gathered for u in ("embed", "head") if u in units)
        if degrees.pp > 1:  # stages keep every unit gathered from forward to its last backward
            kept_layers = {i: units[f"layer.{i}"].gathered for i in layers}
            if last and cfg.train.mtp_loss_weight > 0 and "mtp.0" in units:  # the last stage runs the MTP layer
                gathered_root += units["mtp.0"].gathered
        static["gathered parameters (kept)"] = gathered_root + sum(kept_layers.values())

    fixed = {"masks": act.BOOL * mb.queries * mb.keys if not (one_document and mb.seq <= args.index_topk) else 0}
    head = units.get("head")
    head_grad = args.vocab_size * args.hidden_size * e if last and head is not None and head.grads else 0
    loss, forward_scratch = _loss_terms(args, mb, layers, e, train, last)
    moe_transients = _moe_transients(cfg, args, mb, e, degrees)
    held = _head_gradients(cfg, args, degrees, precision, fsdp, accumulating, head_grad)
    mtp_saved, mtp_backward = _mtp_terms(cfg, args, mb, e, train, p, head_grad) if last else ({}, {})
    phases = [Phase("forward end", {
        **static, "gradients (accumulated)": grads_all if accumulating else 0,
        "activations (saved)": sum(kept.values()) + other_chunks, **fixed, **loss, **held, **mtp_saved,
        "forward scratch": forward_scratch, **moe_transients})]
    if mtp_backward:  # the MTP loss's backward runs first; its layer's activations are freed after it
        phases.append(Phase("MTP layer backward", {
            **static, "gradients (accumulated)": grads_all if accumulating else 0,
            "activations (saved)": sum(kept.values()) + other_chunks, **fixed, **loss, **held, **mtp_backward,
            **moe_transients}))

    done = 0  # sharded gradients finished (not accumulating); the head's is `held` until then
    below = sum(kept.values())
    order = list(reversed(layers))
    for n, i in enumerate(order):
        below -= kept[i]
        unit = units.get(f"layer.{i}")
        still_gathered = {"gathered parameters (kept)": gathered_root + sum(kept_layers[j] for j in order[n:])} \
            if kept_layers else {}  # units whose backward has ended are resharded
        parts = {**static, **still_gathered, "gradients": grads_all if accumulating else done + (unit.grads if unit else 0), **held,
                 "activations (saved)": below + other_chunks, **fixed,
                 f"layer {i}: saved + recomputed": kept[i] + recompute[i],
                 f"layer {i}: backward scratch": act.backward_transient(args, mb, i, e, train, score_buffer),
                 **(moe_transients if args.mlp_layer_types[i] == "sparse" else {})}
        if fsdp and unit is not None:
            parts.update(_fsdp_transient(units, order, n, e, gathered_root > 0 and degrees.pp > 1))
        phases.append(Phase(f"layer {i} backward", parts))
        if unit is not None:
            done += unit.grads
    if kept_layers:  # every layer's backward has ended: only the roots stay gathered
        static["gathered parameters (kept)"] = gathered_root
    if fsdp:  # the root's post-backward: embedding and head gradients unsharded, staged in fp32, reduced
        root = sum(units[u].trainable_gathered for u in ("embed", "head") if u in units)
        phases.append(Phase("root gradient reduction", {
            **static, "gradients": grads_all, "root gradients (unsharded + fp32 staging)": root * (e + act.F32)}))
    phases.append(Phase("optimizer step", {**static, "gradients": grads_all}))
    peak = max(phases, key=lambda ph: ph.total)
    return MemoryPlan(rank, state, peak, phases, {i: kept[i] for i in layers})


def _head_gradients(cfg: JobConfig, args, degrees: MeshDegrees, precision, fsdp: bool, accumulating: bool,
                    head_grad: int) -> dict[str, int]:
    """The head's weight gradient as the last stage holds it from the loss to the root's reduction."""
    # The fused loss computes it in forward. Under FSDP2 it stays an unsharded gradient of the
    # root unit until the root reduces, after the embedding's backward.
    held = {"head weight gradient (from the fused loss)": head_grad} if fsdp or not accumulating else {}
    # Between a pipeline's microbatches FSDP2 keeps each unit's gradient unsharded, upcast to the
    # reduce dtype (fp32) when the parameter is narrower (torch's
    # FSDPParam.to_accumulated_grad_if_needed), until the unit's last microbatch reduces it. The
    # head's is the one the last stage's phases hold on top of the bf16 gradient the fused loss
    # computes each microbatch (measured: sft_4k's last stage, 3.5 GiB of its 3.9 GiB gap).
    narrow_head = precision.param_dtype.itemsize < 4
    if head_grad and fsdp and narrow_head and degrees.pp > 1 and pipeline_microbatches(cfg) > 1:
        held["head gradient accumulated over the microbatches (fp32)"] = args.vocab_size * args.hidden_size * act.F32
    return held


def _mtp_terms(cfg, args, mb, e: int, train, p, head_grad: int) -> tuple[dict[str, int], dict[str, int]]:
    """The MTP loss's memory on the last stage (`train.mtp_loss_weight` > 0): at the forward's end, its
    layer's saved activations (sized as the deepest MoE layer with an indexer: the MTP layer is one),
    its [enorm(e); hnorm(h)] input rows, its loss rows and the head weight gradient its own fused loss
    computes in forward; during its backward, the layer's recompute instead of the loss terms."""
    if cfg.train.mtp_loss_weight <= 0 or not args.num_nextn_predict_layers:
        return {}, {}
    like = max(i for i in range(args.num_hidden_layers)
               if args.mlp_layer_types[i] == "sparse" and args.indexer_types[i] == "full")
    kept, recompute = _layer_activations(args, mb, [like], e, train, p)
    rows = e * mb.queries * args.hidden_size
    saved = {"MTP layer: activations (saved)": kept[like] + 2 * rows, "MTP loss: hidden rows and their gradient":
             2 * rows, "MTP head weight gradient (its fused loss)": head_grad}
    return saved, {"MTP layer: saved + recomputed": kept[like] + recompute[like] + 2 * rows,
                   "MTP head weight gradient (its fused loss)": head_grad}


def _layer_activations(args, mb, layers: list[int], e: int, train, p) -> tuple[dict[int, int], dict[int, int]]:
    """Per layer: the activations kept for backward under `parallel.activation_checkpointing`,
    and what its backward recomputes."""
    saved = {i: sum(act.layer_saved(args, mb, i, e, train).values()) for i in layers}
    if p.activation_checkpointing == "full":
        kept = {i: e * mb.queries * args.hidden_size for i in layers}
    elif p.activation_checkpointing == "selective":
        kept = {i: act.selective_kept(args, mb, i, e, p.ac_keep_matmul_min_k) for i in layers}
    else:
        kept = dict(saved)
    # A checkpointed layer's backward runs its forward again: everything it saves comes back,
    # but what selective checkpointing kept (beyond the layer input) is not recomputed.
    layer_input = e * mb.queries * args.hidden_size
    recompute = {i: 0 if p.activation_checkpointing == "none" else saved[i] - (kept[i] - layer_input)
                 for i in layers}
    return kept, recompute


def _loss_terms(args, mb, layers: list[int], e: int, train, last: bool) -> tuple[dict[str, int], int]:
    """The last stage's final norm and loss rows, and the forward's largest transient (a logits
    slice of the fused loss, or the indexer's scores)."""
    loss = {}
    if last:
        loss["final norm"] = act._norm(mb.queries, args.hidden_size, e, train.norms)
        loss["loss: hidden rows and their gradient"] = 2 * e * mb.queries * args.hidden_size
    logits_slice = min(2048, mb.queries) * args.vocab_size * (e + act.F32) if last else 0
    indexer_scratch = max((act.indexer_transient(args, mb, e) for i in layers if args.indexer_types[i] == "full"),
                          default=0)
    return loss, max(logits_slice, indexer_scratch)


def _moe_transients(cfg: JobConfig, args, mb, e: int, degrees: MeshDegrees) -> dict[str, int]:
    """What an MoE layer holds for a moment: EP's send buffer, an FP8 projection dequantized."""
    if cfg.model.fp8_base != "none":  # each FP8 projection is dequantized into a transient bf16 weight
        local_experts = args.n_routed_experts // degrees.ep
        dequantized = {"FP8 weight dequantized (largest projection)":
                       2 * local_experts * 2 * args.moe_intermediate_size * args.hidden_size}
    else:
        dequantized = {}
    # Expert parallelism: the all-to-all's send buffer beside the received rows (which the saved
    # activations count), at balanced routing: this rank's token-expert pairs, one direction at a time.
    moe_transients = {"MoE all-to-all buffer": e * mb.queries * args.num_experts_per_tok * args.hidden_size} \
        if degrees.ep > 1 and any(kind == "sparse" for kind in args.mlp_layer_types) else {}
    return {**moe_transients, **dequantized}


def _fsdp_transient(units, order: list[int], n: int, e: int, kept_gathered: bool) -> dict[str, int]:
    """Layer order[n]'s backward under FSDP2: its gathered parameters and the next unit's
    (prefetched), its unsharded gradients in the compute dtype and their fp32 staging copy
    (gradients are reduced in fp32)."""
    unit = units[f"layer.{order[n]}"]
    following = units.get(f"layer.{order[n + 1]}") if n + 1 < len(order) else None
    gathered = 0 if kept_gathered else unit.gathered + (following.gathered if following else 0)
    return {"FSDP: gathered parameters": gathered,
            "FSDP: unsharded gradients + fp32 staging": unit.trainable_gathered * (e + act.F32)}


def _accumulation_steps(cfg: JobConfig, degrees: MeshDegrees) -> int:
    return grad_accum_steps(cfg, degrees)


def describe(plan: MemoryPlan) -> list[tuple[str, float]]:
    """(part, GiB) of the peak phase, largest first."""
    return sorted(((k, v / GIB) for k, v in plan.peak.parts.items() if v), key=lambda kv: -kv[1])

