"""Peak memory of one rank through a training step: model state, activations and transients.

A step is walked phase by phase and the largest total is the planned peak (what
`torch.cuda.max_memory_allocated` measures; the CUDA context, NCCL buffers and the
allocator's fragmentation are the separate headroom line of the plan):
  forward end     parameters + optimizer state (+ gradients already accumulated by earlier
                  micro-batches) + the saved activations of every in-flight micro-batch +
                  the masks and loss buffers (the fused loss computes the head's weight
                  gradient and the hidden-state gradient during forward) + the largest
                  forward scratch (a slice of logits, a score chunk) + the family's transients
  layer l backward  the activations of layers before l, layer l's own (recomputed under
                  activation checkpointing) and its backward scratch, the gradients
                  finished so far, and under FSDP2 this unit's and the next unit's gathered
                  parameters, its unsharded gradients and the reduce-scatter's staging copy
                  in the reduce dtype (fp32)
  root reduction, optimizer step: every gradient, plus under FSDP2 the root unit's
                  (embedding, head) unsharded gradients and their fp32 staging
  paired overlap  under `parallel.pp_ep_overlap` a DualPipeV pair's forward computes beside the
                  backward: each layer's backward also holds a forward's scratch and transients
  pipelines       besides: torch's receive buffers (every microbatch of each stage's inputs and
                  output gradients) and the in-flight stages' outputs for the activations the
                  family names (`StepTerms.boundary`); what each micro-batch in flight holds beside
                  its layers (`StepTerms.per_microbatch`, GLM-5's attention mask); and FSDP2's
                  unsharded fp32 gradients of every stage part-way through its microbatches'
                  backwards (its layers', and the embedding's, head's and auxiliary units' on the
                  first and last stages); under a schedule of several stages per rank, the
                  stages gathered then (torch's lowering gathers the next three to compute) and
                  the sharded gradients of those done — in the rank's backward that holds the
                  most with them (`_backward_state`)

What depends on the architecture (each layer's saved, recomputed and scratch bytes, the masks,
the loss rows, the transients such as an all-to-all buffer or a dequantized FP8 weight, the
auxiliary losses' layers) is the family's memory model, its spec's `memory`
(models/common/memory_model.py; GLM-5's in models/glm5/memory_model.py, the hf family's in
models/hf/memory_model.py): this module knows no family.

Pipeline schedules keep several micro-batches in flight on a rank: 1F1B's warm-up holds pp - r
of them on pp rank r, GPipe all of them; a schedule with v stages per rank holds what torch's own
order for the rank gives (`glmtune/distributed/schedule_order.py`; Interleaved1F1B's is
(v - 1) pp + 2 (pp - 1 - r) + 1 stage-chunks, DualPipeV's 2 pp + 1 on every rank with 16
microbatches over pp 4); under activation checkpointing the pipeline runs the zero-bubble
schedules' split backwards whole (`pipeline.py`), so a chunk is freed at its input half, else at
its weight half. Without checkpointing a split backward also keeps, between its halves, the
gradients at the layers' intermediates, which this plan does not count. A
one-stage schedule's units stay gathered from their first forward to their last microbatch's
backward (a multi-stage schedule's: while their stage is among the next three to compute), and
units reduce their gradients after their last microbatch's backward: a step's first backward finds no gradient of this step yet
(measured on one H200 with `glmtune plan --measure`, 2026-12-03: counting every gradient from
the first backward put the first stage of recipes/glm5/sft_4k.yaml 14% above its measured peak).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmtune.config import JobConfig
from glmtune.config.degrees import MeshDegrees
from glmtune.config.validate import grad_accum_steps, pipeline_microbatches
from glmtune.distributed.exchange_keeper import kept_row_exchanges
from glmtune.distributed.mesh import ParallelMesh
from glmtune.distributed.schedule_order import backward_states, chunks_in_flight
from glmtune.models.common.memory_model import LayerMemory, StepShape, StepTerms
from glmtune.models.registry import model_spec
from glmtune.plan.model_state import StateBytes, layer_stages, memory_model_of, stage_of_unit
from glmtune.train.precision import resolve_precision

GIB = 2**30
F32 = 4  # gradients are reduced, and a pipeline accumulates a narrow head's, in fp32


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
    # torch's own order; under checkpointing the pipeline runs split backwards whole (pipeline.py)
    return chunks_in_flight(p.pp_schedule, degrees.pp, v, microbatches, pp_rank,
                            whole_backward=p.activation_checkpointing != "none")


def _compute_size(cfg: JobConfig) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4


def fused_norms(cfg: JobConfig) -> bool:
    """Whether the norms run the Triton kernels (`model.norm_backend`): triton, or auto on a job that
    runs on a GPU, which a plan is for unless `train.device: cpu` says otherwise."""
    return cfg.model.norm_backend == "triton" or (cfg.model.norm_backend == "auto" and cfg.train.device != "cpu")


def step_shape(cfg: JobConfig, degrees: MeshDegrees, one_document: bool = True) -> StepShape:
    """One rank's micro-batch under `degrees` and the recipe's settings the memory model reads."""
    p = cfg.parallel
    rows = cfg.train.micro_batch_size
    if degrees.pp > 1:
        rows = max(1, rows // pipeline_microbatches(cfg))
    return StepShape(rows, cfg.data.packed_sequence_size, degrees.cp, one_document, _compute_size(cfg),
                     p.activation_checkpointing, cfg.peft.rank if cfg.peft.method == "lora" else 0, degrees.ep,
                     p.ac_keep_matmul_min_k, cfg.model.attention_score_buffer_mib << 20,
                     cfg.model.fp8_base != "none", cfg.train.mtp_loss_weight > 0,
                     cfg.model.attention_backend in ("absorbed", "absorbed_triton"), fused_norms(cfg),
                     kept_row_exchanges(p.ep_keep_exchanges), cfg.model.fp8_base == "triton")


@dataclass
class _RankStep:
    """What the phases of one rank's step are made of (gathered by plan_rank_memory)."""

    layers: list[int]  # the rank's decoder layers, in forward order
    per_layer: dict[int, LayerMemory]  # the family's bytes of each of them
    kept: dict[int, int]  # layer -> its saved activations per micro-batch, as kept
    other_chunks: int  # saved activations of the other in-flight stage-chunks
    units: dict  # state.units: FSDP unit -> its UnitBytes
    fsdp: bool
    e: int  # bytes of one element in the compute dtype
    static: dict[str, int]  # held through the step: parameters, optimizer state, units kept gathered
    grads_all: int  # every sharded gradient of the rank
    accumulating: bool  # gradients of the step's earlier micro-batches are held
    gathered_root: int  # FSDP2: the root units' gathered bytes (and a last stage's auxiliary units')
    kept_layers: dict[int, int]  # FSDP2 under a pipeline: layer -> its unit's gathered bytes
    fixed: dict[str, int]  # masks, per-micro-batch terms, the pipeline's stage-boundary tensors
    held: dict[str, int]  # the head's gradient from the fused loss; the stages' accumulated gradients
    # parallel.pp_ep_overlap: a paired forward computes beside each backward, holding its scratch and transients
    paired_forward: int = 0
    # layers whose unit holds its gradient accumulated over the microbatches (counted in `held`)
    accumulating_layers: frozenset[int] = frozenset()
    # a multi-stage schedule: the sharded gradients of the stages done at the planned backward (its
    # `gathered_root` is what the gathered stages hold then); None otherwise
    finished_grads: int | None = None


def plan_rank_memory(model, cfg: JobConfig, degrees: MeshDegrees, rank: int, state: StateBytes,
                     one_document: bool = True) -> MemoryPlan:
    """The phases of one step on global rank `rank` holding `state` (module docstring)."""
    spec = model_spec(cfg.model)
    memory, args = memory_model_of(cfg), spec.architecture.args_of(model)
    step = step_shape(cfg, degrees, one_document)
    e = step.compute_bytes
    precision = resolve_precision(cfg)
    fsdp = degrees.fsdp_applies()
    pp_rank = ParallelMesh(degrees, rank=rank).rank("pp")
    stage, stages_of_rank = layer_stages(model, cfg, degrees)
    mine, layers, last = _rank_layers(stage, stages_of_rank, pp_rank, spec.architecture.num_layers(args))
    per_layer = {i: memory.layer(args, step, i) for i in layers}
    # a layer keeps what the previous layer of its stage hands it (`LayerMemory.input_kept`)
    kept = {i: per_layer[i].kept + (per_layer[i].input_kept if i - 1 in per_layer and stage[i - 1] == stage[i] else 0)
            for i in layers}
    terms = memory.step_terms(args, step, layers, last)

    units = state.units

    def in_flight_parts(chunks: int) -> tuple[int, dict[str, int]]:
        return _in_flight_parts(cfg, degrees, mine, last, chunks, terms, kept)

    def in_flight_bytes(chunks: int) -> int:
        other_chunks, fixed = in_flight_parts(chunks)
        return other_chunks + sum(fixed.values())

    accumulates = _fp32_between_microbatches(cfg, degrees, precision, fsdp)
    lowered = fsdp and degrees.pp > 1 and cfg.parallel.pp_stages_per_rank > 1  # torch gathers <= 3 stages at once
    held_state = _BackwardState(in_flight(cfg, degrees, pp_rank))
    if accumulates or lowered:
        outer = ["embed", "head", *memory.auxiliary_units(step)]
        held_state = _backward_state(cfg, degrees, pp_rank, stage, stages_of_rank, units, outer, in_flight_bytes,
                                     accumulates, lowered)
    other_chunks, fixed = in_flight_parts(held_state.chunks)

    static = {"parameters": state.params, "optimizer state": state.optimizer}
    # Gradients of an earlier micro-batch of the step are held only when the trainer accumulates
    # micro-batches. A pipeline's microbatches do not: each unit reduces its gradient once, after
    # its last microbatch's backward, and the step's first backward finds none (zero_grad frees them).
    accumulating = _accumulation_steps(cfg, degrees) > 1
    gathered_root, kept_layers = _gathered_units(units, degrees, layers, last, memory, step) if fsdp else (0, {})
    if held_state.gathered is not None:  # a multi-stage schedule: the stages torch's lowering keeps gathered then
        gathered_root, kept_layers = held_state.gathered, {}
    if fsdp:
        static["gathered parameters (kept)"] = gathered_root + sum(kept_layers.values())

    head = units.get("head")
    head_grad = terms.head_elements * e if last and head is not None and head.grads else 0
    # The fused loss computes the head's weight gradient in forward. Under FSDP2 it stays an unsharded
    # gradient of the root unit until the root reduces, after the embedding's backward.
    held = {"head weight gradient (from the fused loss)": head_grad} if fsdp or not accumulating else {}
    if last and degrees.pp > 1 and head_grad:  # a last-stage chunk in flight beside another stage's backward
        held.update(memory.auxiliary_held(args, step, head_grad))
    held.update(held_state.accumulated)
    aux_saved, aux_backward = memory.auxiliary(args, step, head_grad) if last else ({}, {})
    paired = terms.forward_scratch + sum(terms.transients.values()) if cfg.parallel.pp_ep_overlap else 0
    r = _RankStep(layers, per_layer, kept, other_chunks, units, fsdp, e, static, state.grads, accumulating,
                  gathered_root, kept_layers, fixed, held, paired, held_state.accumulating_layers,
                  held_state.finished_grads)
    phases = _forward_phases(r, terms, aux_saved, aux_backward) + _backward_phases(r) + _closing_phases(r)
    peak = max(phases, key=lambda ph: ph.total)
    return MemoryPlan(rank, state, peak, phases, kept)


def _in_flight_parts(cfg: JobConfig, degrees: MeshDegrees, mine: list[int], last: bool, chunks: int,
                     terms: StepTerms, kept: dict[int, int]) -> tuple[int, dict[str, int]]:
    """With `chunks` stage-chunks in flight: the saved activations of the chunks other than the one in
    backward, and the fixed terms (masks, per-micro-batch terms, the stage-boundary tensors)."""
    # Other in-flight stage-chunks hold about the rank's average stage of layers each, less the first
    # layer's input of each chunk a pipeline received (its receive buffer, counted with the boundary's).
    boundary, received = _stage_boundary(cfg, degrees, mine, last, chunks, terms)
    other_chunks = (chunks - 1) * sum(kept.values()) // max(1, len(mine)) - received
    return other_chunks, {**terms.fixed, **{k: v * chunks for k, v in terms.per_microbatch.items()}, **boundary}


def _per_stage(units: dict, outer_units: list[str], stage: list[int], final: int, size) -> dict[int, int]:
    """Stage -> the sum of `size(unit)` over its layer units and the outer units it runs (the first
    stage's embedding; the last's head and the family's auxiliary units that train)."""
    per_stage: dict[int, int] = {}
    for name, unit in units.items():
        if name.startswith("layer.") or name in outer_units:
            s = stage_of_unit(name, stage, final)
            per_stage[s] = per_stage.get(s, 0) + size(unit)
    return per_stage


@dataclass
class _BackwardState:
    """What a pipeline rank holds at the backward the plan takes (`_backward_state`)."""

    chunks: int  # stage-chunks in flight
    accumulated: dict[str, int] = field(default_factory=dict)  # each accumulating stage's fp32 accumulators
    accumulating_layers: frozenset[int] = frozenset()  # the layers of those stages
    gathered: int | None = None  # a multi-stage schedule: its gathered stages' parameters
    finished_grads: int | None = None  # a multi-stage schedule: the sharded gradients of its stages done


def _backward_state(cfg: JobConfig, degrees: MeshDegrees, pp_rank: int, stage: list[int],
                    stages_of_rank: list[list[int]], units: dict, outer_units: list[str], in_flight_bytes,
                    accumulates: bool, lowered: bool) -> _BackwardState:
    """The rank's pipeline backward that holds the most (`schedule_order.backward_states`): its
    stage-chunks in flight; with `accumulates` (microbatches keep FSDP2's unsharded gradients between
    them, upcast to fp32: torch's FSDPParam.to_accumulated_grad_if_needed; only the last microbatch's
    backward reduces) each accumulating stage's units' fp32 gradients; with `lowered` (a multi-stage
    schedule under FSDP2) its gathered stages' parameters and the sharded gradients of its stages done
    with the step's backwards.
    `stage`, `stages_of_rank`: `layer_stages`'."""
    final = max(max(s) for s in stages_of_rank)
    accumulators = _per_stage(units, outer_units, stage, final, lambda u: u.trainable_gathered * F32) \
        if accumulates else {}
    gathered = _per_stage(units, outer_units, stage, final, lambda u: u.gathered) if lowered else {}
    sharded_grads = _per_stage(units, outer_units, stage, final, lambda u: u.grads) if lowered else {}
    p, microbatches = cfg.parallel, pipeline_microbatches(cfg)
    if p.pp_stages_per_rank > 1:
        states = backward_states(p.pp_schedule, degrees.pp, p.pp_stages_per_rank, microbatches, pp_rank,
                                 whole_backward=p.activation_checkpointing != "none")
    else:  # one stage: its second microbatch's backward on hold it, with no more in flight than at its first
        mine = frozenset(stages_of_rank[pp_rank])
        states = {(in_flight(cfg, degrees, pp_rank), mine, mine, frozenset())}

    def held(st) -> int:
        chunks, accumulating, active, finished = st
        return (in_flight_bytes(chunks) + sum(accumulators.get(s, 0) for s in accumulating)
                + sum(gathered.get(s, 0) for s in active) + sum(sharded_grads.get(s, 0) for s in finished))

    chunks, stages, active, finished = max(states, key=held)
    lines = {f"stage {s} gradients accumulated over the microbatches (fp32)": accumulators[s]
             for s in sorted(stages) if accumulators.get(s)}
    layers = frozenset(i for i, s in enumerate(stage) if s in stages)
    if not lowered:
        return _BackwardState(chunks, lines, layers)
    return _BackwardState(chunks, lines, layers, sum(gathered.get(s, 0) for s in active),
                          sum(sharded_grads.get(s, 0) for s in finished))


def _rank_layers(stage: list[int], stages_of_rank: list[list[int]], pp_rank: int,
                 num_layers: int) -> tuple[list[int], list[int], bool]:
    """Pipeline rank `pp_rank`'s stages, their decoder layers, and whether the last stage is among them
    (`stage`, `stages_of_rank`: `layer_stages`')."""
    mine = stages_of_rank[pp_rank]
    layers = [i for i in range(num_layers) if stage[i] in mine]
    last = max(max(s) for s in stages_of_rank) in mine
    return mine, layers, last


def _gathered_units(units: dict, degrees: MeshDegrees, layers: list[int], last: bool, memory,
                    step: StepShape) -> tuple[int, dict[int, int]]:
    """Under FSDP2, the root units' gathered bytes, and a pipeline's layer units kept gathered (layer -> bytes)."""
    # The root unit (embedding, final norm, head) stays gathered between forward and backward.
    gathered_root = sum(units[u].gathered for u in ("embed", "head") if u in units)
    kept_layers: dict[int, int] = {}  # layer -> its unit's gathered bytes, kept until its backward ends
    # A one-stage schedule keeps every unit gathered from forward to its last backward (a multi-stage
    # one's lowering gathers three stages at a time: `_backward_state` replaces these then).
    if degrees.pp > 1:
        kept_layers = {i: units[f"layer.{i}"].gathered for i in layers}
        if last:  # the last stage runs the family's auxiliary units (GLM-5's MTP layer)
            gathered_root += sum(units[u].gathered for u in memory.auxiliary_units(step) if u in units)
    return gathered_root, kept_layers


def _forward_phases(r: _RankStep, terms: StepTerms, aux_saved: dict[str, int],
                    aux_backward: dict[str, int]) -> list[Phase]:
    """The forward's end and, where the family has an auxiliary loss, that loss's backward."""
    phases = [Phase("forward end", {
        **r.static, "gradients (accumulated)": r.grads_all if r.accumulating else 0,
        "activations (saved)": sum(r.kept.values()) + r.other_chunks, **r.fixed, **terms.loss, **r.held,
        **aux_saved, "forward scratch": terms.forward_scratch, **terms.transients})]
    if aux_backward:  # an auxiliary loss's backward runs first; its layer's activations are freed after it
        phases.append(Phase("MTP layer backward", {
            **r.static, "gradients (accumulated)": r.grads_all if r.accumulating else 0,
            "activations (saved)": sum(r.kept.values()) + r.other_chunks, **r.fixed, **terms.loss, **r.held,
            **aux_backward, **terms.transients}))
    return phases


def _backward_phases(r: _RankStep) -> list[Phase]:
    """Each of the rank's layers' backward, the last layer first."""
    phases = []
    done = 0  # sharded gradients finished (not accumulating); the head's is `held` until then
    below = sum(r.kept.values())
    order = list(reversed(r.layers))
    for n, i in enumerate(order):
        below -= r.kept[i]
        unit = r.units.get(f"layer.{i}")
        still_gathered = {"gathered parameters (kept)": r.gathered_root + sum(r.kept_layers[j] for j in order[n:])} \
            if r.kept_layers else {}  # units whose backward has ended are resharded
        # A unit's sharded gradient is made by its reduce-scatter, after its backward (a pipeline's:
        # after its last microbatch's, once that backward's activations are freed).
        own_grad = unit.grads if unit and not (r.kept_layers or r.finished_grads is not None) else 0
        layer = r.per_layer[i]
        parts = {**r.static, **still_gathered,
                 "gradients": r.grads_all if r.accumulating else (
                     done + own_grad if r.finished_grads is None else r.finished_grads), **r.held,
                 "activations (saved)": below + r.other_chunks, **r.fixed,
                 f"layer {i}: saved + recomputed": r.kept[i] + layer.recomputed,
                 f"layer {i}: backward scratch": layer.backward_scratch,
                 **layer.transients}
        if r.paired_forward:
            parts["the paired forward's scratch (pp_ep_overlap)"] = r.paired_forward
        if r.fsdp and unit is not None:  # under a pipeline the unit is gathered already (its stage's)
            parts.update(_fsdp_transient(r.units, order, n, r.e, bool(r.kept_layers) or r.finished_grads is not None,
                                         i in r.accumulating_layers))
        phases.append(Phase(f"layer {i} backward", parts))
        if unit is not None:
            done += unit.grads
    return phases


def _closing_phases(r: _RankStep) -> list[Phase]:
    """After every layer's backward: the root's gradient reduction (FSDP2) and the optimizer step."""
    static = r.static
    if r.kept_layers:  # every layer's backward has ended: only the roots stay gathered
        static = {**static, "gathered parameters (kept)": r.gathered_root}
    optimizer_static = static
    if r.finished_grads is not None:  # torch's lowering reshards every stage after the rank's last action
        optimizer_static = {**static, "gathered parameters (kept)": 0}
    phases = []
    if r.fsdp:  # the root's post-backward: embedding and head gradients unsharded, staged in fp32, reduced
        root = sum(r.units[u].trainable_gathered for u in ("embed", "head") if u in r.units)
        phases.append(Phase("root gradient reduction", {
            **static, "gradients": r.grads_all, "root gradients (unsharded + fp32 staging)": root * (r.e + F32)}))
    phases.append(Phase("optimizer step", {**optimizer_static, "gradients": r.grads_all}))
    return phases


def _fp32_between_microbatches(cfg: JobConfig, degrees: MeshDegrees, precision, fsdp: bool) -> bool:
    """Whether FSDP2 keeps a unit's unsharded gradient in fp32 from its first microbatch's backward to
    its last's (a pipeline's microbatches do not sync; a narrower parameter's gradient is upcast to
    the reduce dtype: torch's FSDPParam.to_accumulated_grad_if_needed)."""
    narrow = precision.param_dtype.itemsize < 4
    return fsdp and narrow and degrees.pp > 1 and pipeline_microbatches(cfg) > 1


def _stage_boundary(cfg: JobConfig, degrees: MeshDegrees, mine: list[int], last: bool, chunks: int,
                    terms) -> tuple[dict[str, int], int]:
    """A pipeline rank's stage-boundary tensors, and the bytes of them its layers' kept inputs count.

    torch's PipelineStage allocates, once, a receive buffer for every microbatch of each stage's
    inputs and of each stage's output gradients (`_make_tensor_from_meta`); every activation that
    crosses a boundary has its own (`terms.boundary`, the activations the family counts them for:
    GLM-5's next tokens' embeddings with its MTP loss). A non-last stage's outputs are kept by the
    schedule from its forward to its backward: one per activation for each in-flight stage-chunk
    but those of the last stage. A received activation that is the first layer's input is counted
    by the layers' kept activations for the in-flight chunks of non-first stages (`received`)."""
    if degrees.pp == 1 or not terms.boundary:
        return {}, 0
    microbatches, per_chunk = pipeline_microbatches(cfg), sum(terms.boundary)
    first = 0 in mine
    # in-flight chunks of the first stage (all of its microbatches run before the rank's first
    # backward) and of the last stage (one under 1F1B schedules; all of them under GPipe)
    first_chunks = min(chunks, microbatches) if first else 0
    last_chunks = min(chunks, microbatches if cfg.parallel.pp_schedule == "GPipe" else 1) if last else 0
    parts = {"pipeline: receive buffers (inputs)": microbatches * (len(mine) - first) * per_chunk,
             "pipeline: receive buffers (output gradients)": microbatches * (len(mine) - last) * per_chunk,
             "pipeline: stage outputs in flight": (chunks - last_chunks) * per_chunk}
    return parts, (chunks - first_chunks) * terms.received_kept


def _fsdp_transient(units, order: list[int], n: int, e: int, kept_gathered: bool,
                    accumulates: bool = False) -> dict[str, int]:
    """Layer order[n]'s backward under FSDP2: its gathered parameters and the next unit's
    (prefetched), its unsharded gradients in the compute dtype and their fp32 staging copy
    (gradients are reduced in fp32) — or, where the unit's fp32 accumulator is held already
    (`accumulates`), only this microbatch's gradient, until FSDP2 adds it in."""
    unit = units[f"layer.{order[n]}"]
    following = units.get(f"layer.{order[n + 1]}") if n + 1 < len(order) else None
    gathered = 0 if kept_gathered else unit.gathered + (following.gathered if following else 0)
    return {"FSDP: gathered parameters": gathered,
            "FSDP: unsharded gradients + fp32 staging": unit.trainable_gathered * (e + (0 if accumulates else F32))}


def _accumulation_steps(cfg: JobConfig, degrees: MeshDegrees) -> int:
    return grad_accum_steps(cfg, degrees)


def describe(plan: MemoryPlan) -> list[tuple[str, float]]:
    """(part, GiB) of the peak phase, largest first."""
    return sorted(((k, v / GIB) for k, v in plan.peak.parts.items() if v), key=lambda kv: -kv[1])

