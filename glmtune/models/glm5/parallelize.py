"""`parallelize_glm5`: turns a built (plain PyTorch) GLM-5 into a training-ready one.

Transformations apply in this fixed order, each one optional:
  0. pipeline split (PP)           - the model pruned to this pp rank's stages (consecutive
                                     layers, balanced by GLM-5's costs: `split_model`); everything
                                     below applies to what is left, each stage its own FSDP root,
                                     and `glmtune/distributed/pipeline.py` runs the stages
  1. expert parallelism (EP)       - routed experts sharded over an `ep` mesh axis
  2. context parallelism (CP)      - sequence sharded over a `cp` mesh axis
  3. activation checkpointing (AC) - per decoder layer: "full", or "selective" (keeps top-k
                                     masks, attention and wide matmul outputs)
  4. torch.compile                 - per decoder layer (the unit AC and FSDP wrap)
  5. FSDP2 (`fully_shard`)         - per router, per decoder and MTP layer, then the root;
                                     HSDP (replicate x shard) when dp_replicate > 1

The pipeline split comes first because it decides which layers this process holds at
all. EP and CP come next because they change what a layer computes and which
tensors exist; AC and compile wrap the resulting layer; FSDP2 goes last so it
shards the final parameters and its hooks wrap everything else. Tensor parallelism
is refused by the mesh (glmtune/distributed/mesh.py).

FSDP2 gathers the parameters in their own dtype (no cast: fp32 master weights are the
optimizer's, `glmtune/train/master_adamw.py`) and reduces gradients in fp32, so that a sum
over many ranks rounds once, into the bf16 gradient, instead of at every step of a ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from glmtune.distributed.context_parallel import apply_context_parallel
from glmtune.distributed.exchange_keeper import KEEP_CHOICES, KEPT_EXCHANGES, Keeper, keeping
from glmtune.distributed.expert_parallel import apply_expert_parallel
from glmtune.distributed.pipeline import Pipeline
from glmtune.distributed.pipeline_plan import plan_stages, stage_ids_for_rank
from glmtune.kernels import lora_ops as _lora_ops  # noqa: F401  (registers glmtune::lora_linear)
from glmtune.models.common.step_runner_pipelined import PipelinedRunner
from glmtune.models.common.token_dispatch import expert_layers
from glmtune.models.glm5.model import Glm5ForCausalLM
from glmtune.models.glm5.moe import MoE, Router
from glmtune.models.glm5.stage_costs import head_cost, layer_costs
from glmtune.models.glm5.stages import Glm5Stage, decoder_layers, needs_carry, split_into_stages


def _saved_under_checkpointing():
    aten = torch.ops.aten
    # Registered by the model's indexer, GEMM-, Triton-, absorbed- and sparse-MLA-attention modules, and the indexer's
    # KL (`indexer_loss.py`: its saved gradients, linear in the tokens, instead of a second KL pass).
    ops = [torch.ops.glmtune.dsa_topk_mask.default, torch.ops.glmtune.gemm_attention.default,
           torch.ops.glmtune.sparse_attention.default, torch.ops.glmtune.indexer_kl.default,
           torch.ops.glmtune.absorbed_attention.default, torch.ops.glmtune.selected_keys.default,
           torch.ops.glmtune.sparse_mla.default]
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.append(getattr(aten, name).default)
    return frozenset(ops)


_SAVED = _saved_under_checkpointing()


def _ignore_profiler_ranges_under_selective_checkpointing() -> None:
    """Selective checkpointing replays the region's ops by per-op invocation counts, and FSDP2's
    hooks open profiler ranges ("FSDP::all_gather", ...) inside an expert-parallel layer (its experts
    are their own FSDP unit) a different number of times in forward and in recomputation, so such a
    layer failed in backward with "profiler._record_function_enter_new ... not
    found in storage". A range marks no tensor computation: torch's fix (pytorch/pytorch#196862,
    torchtitan#3427) adds these ops to the set selective checkpointing does not count; torch 2.11-2.13
    lack it, so the set is extended here, once."""
    profiler = torch.ops.profiler
    ranges = {profiler._record_function_enter_new.default, profiler._record_function_exit._RecordFunction}
    torch.utils.checkpoint.SAC_IGNORED_OPS.update(ranges)


_ignore_profiler_ranges_under_selective_checkpointing()


# Operand whose last dim is the reduction dim; the LoRA op's base product reduces over x's width.
_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.glmtune.lora_linear.default: 0}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _MATMULS[torch.ops.aten._grouped_mm.default] = 0
# Matmul outputs are kept when their reduction dim is at least this: recomputing one kept
# bf16 element would cost 2 x K FLOPs. At GLM-5 widths that keeps the products of the
# 6144-wide hidden state (q_a, kv_a, expert gate/up, router) and of the 16384-wide
# attention output (o_proj), and recomputes the cheap-per-byte ones (q_b, kv_b, expert down).
KEEP_MATMUL_MIN_K = 4096


def _keep_quadratic_and_wide_matmuls(min_k, ctx, func, *args, **kwargs):
    # Recompute is cheap for everything but the layer's quadratic parts: the DSA top-k
    # mask (scores over every past key, then top-k; S x T bools) and the attention
    # itself (output and log-sum-exp: ~N x S x (V + 1) per layer). Those are kept, and
    # so are matmuls expensive per kept byte (above).
    if func in _SAVED:
        return CheckpointPolicy.MUST_SAVE
    operand = _MATMULS.get(func)
    if operand is not None and args[operand].shape[-1] >= min_k:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keeping_exchanges(original_forward, exchanges: frozenset[str]):
    """`original_forward` as one checkpointed call whose recomputation replays the expert exchanges
    its forward received (`glmtune.distributed.exchange_keeper`); as it is when none are kept."""
    if not exchanges:
        return original_forward
    keeper, records = Keeper(exchanges), torch.is_grad_enabled()  # without gradients nothing is recomputed

    def run(*args, **kwargs):
        with keeping(keeper, records):
            return original_forward(*args, **kwargs)
    return run


def _checkpointed_forward(original_forward, keep_min_k, exchanges, *args, **kwargs):
    original_forward = _keeping_exchanges(original_forward, exchanges)
    if keep_min_k is None:  # full recompute
        return checkpoint(original_forward, *args, use_reentrant=False, **kwargs)
    policy = functools.partial(_keep_quadratic_and_wide_matmuls, keep_min_k)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(original_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_activation_checkpointing(model: Glm5ForCausalLM, mode: str = "selective",
                                   keep_matmul_min_k: int = KEEP_MATMUL_MIN_K, keep_exchanges: str = "none") -> None:
    """Recompute each decoder layer in backward. "full" recomputes everything (least
    memory); "selective" keeps the top-k selection, the attention and the matmuls with a
    reduction dim >= `keep_matmul_min_k`. `keep_exchanges` ("none", "counts", "combine", "dispatch", "both"):
    the expert all-to-alls whose received rows the forward keeps for the recomputation
    (`glmtune.distributed.exchange_keeper`). Parameter names are unchanged (no wrapper
    module), so checkpoints and adapters see the same keys in every mode."""
    if mode not in ("full", "selective"):
        raise ValueError(f"parallel.activation_checkpointing={mode!r}: choose none, full or selective")
    if keep_exchanges not in KEEP_CHOICES or (keep_exchanges != "none" and mode != "full"):
        raise ValueError(f"ep_keep_exchanges {keep_exchanges!r}: choose from {KEEP_CHOICES}; kept exchanges need "
                         "activation_checkpointing full")
    keep = keep_matmul_min_k if mode == "selective" else None
    exchanges = KEPT_EXCHANGES[keep_exchanges]
    for layer in [*decoder_layers(model), *model.mtp]:  # an MTP layer runs only when it trains
        layer.forward = functools.partial(_checkpointed_forward, layer.forward, keep, exchanges)


def apply_compile(model: Glm5ForCausalLM) -> None:
    for layer in [*decoder_layers(model), *model.mtp]:
        layer.compile()


def _expert_placement(num_experts: int, shards: int):
    """Shard experts' FSDP2 dim 1 when there are more shards than (local) experts."""
    return (lambda param: Shard(1)) if shards > num_experts else None


def apply_fsdp(model: Glm5ForCausalLM, mesh, reduce_dtype: torch.dtype = torch.float32, expert_mesh=None,
               stages=None) -> None:
    """Shard with FSDP2: each router, the routed experts (under EP), each decoder and MTP
    layer, then the root (embedding, final norm, head).

    Routers are units of their own that keep their fp32 weight:
    routing runs in fp32 whatever the layers compute in, and a unit needs one parameter
    dtype (a bf16 layer around an fp32 router is refused by `fully_shard`). MTP layers
    run only when their loss is on: as their own units they are otherwise never gathered.
    Under expert parallelism (`expert_mesh` given) the routed experts, already split
    over the ep ranks, are a unit of their own sharded over the ranks that hold the
    same experts (efsdp); everything else is sharded over the dense mesh.

    LoRA needs no unit of its own: `fully_shard` asks one dtype of a unit's *trainable*
    parameters only. A LoRA layer over a frozen bf16 base (the GLM-5 LoRA recipes) holds bf16
    base weights and fp32 adapters, the routed experts (`LoRAGroupedExperts`) their bf16
    stacks and fp32 stacked adapters: the trainable ones
    are all fp32, FSDP2 all-gathers the mixed unit through one byte buffer and reduces the
    adapters' gradients in fp32, and the adapters compute in fp32 as in one process
    (tests/distributed/test_lora_bf16_train.py).

    Gradient arithmetic: the trainer divides each rank's loss sum by the global count of
    supervised tokens, so the gradient of the step's loss is the plain sum of the ranks'
    gradients. Every unit therefore sums (divide factor 1, no averaging), with sum-only
    collectives (gloo has no pre-multiplied sum), the same over every mesh — FSDP2's
    default averaging would divide expert gradients by efsdp and the others by dp_shard.
    Expert gradients are complete on the rank that holds the expert and are summed over
    efsdp only, never over ep.

    Under pipeline parallelism (`stages` given) each stage is a root unit of its own (its
    embedding, final norm and head): the schedule runs stages, not the model. The MTP layer's unit
    is then under the last stage's root when its loss trains, and under no root otherwise. Units keep
    their gathered parameters from forward to backward (no reshard after forward):
    resharding would all-gather every layer again for every microbatch.
    """
    own_dtype = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    # FSDP2's own default (None: reshard every unit but the root) without a pipeline; False under one.
    reshard = None if stages is None else False
    for layer in [*decoder_layers(model), *model.mtp]:
        for module in layer.modules():
            if isinstance(module, Router):
                fully_shard(module, mesh=mesh, mp_policy=own_dtype, reshard_after_forward=reshard)
            if isinstance(module, MoE) and expert_mesh is not None:
                local_experts = module.experts.gate_up_proj.to_local().shape[0] \
                    if hasattr(module.experts.gate_up_proj, "to_local") else module.num_experts
                fully_shard(module.experts, mesh=expert_mesh, mp_policy=own_dtype, reshard_after_forward=reshard,
                            shard_placement_fn=_expert_placement(local_experts, expert_mesh.size()))
        fully_shard(layer, mesh=mesh, mp_policy=own_dtype, reshard_after_forward=reshard)
    roots = [model] if stages is None else stages
    for root in roots:
        fully_shard(root, mesh=mesh, mp_policy=own_dtype, reshard_after_forward=reshard)
    for module in [*model.modules(), *(m for root in roots for m in root.modules())]:
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def split_model(model: Glm5ForCausalLM, *, pp: int, pp_rank: int, schedule: str, stages_per_rank: int,
                seq_len: int, explicit_split: list[int] | None = None,
                loss_chunk_size: int = 2048, mtp: bool = False, indexer_kl: bool = False,
                distill: bool = False) -> list[Glm5Stage]:
    """Prune `model` to this pp rank's stages and return them: the layers split by their training
    cost (`stage_costs.py`, balanced by `glmtune/distributed/pipeline_plan.py`) or as
    `explicit_split` says, the stages placed on ranks as `schedule` wants (`models/glm5/stages.py`;
    `mtp`: the last stage runs the MTP layer and its loss; `indexer_kl`: every layer computes its
    indexer's KL loss; `distill`: the last stage adds a teacher's KL term).

    Trained indexers (`model.indexer_trainable`): a shared-indexer layer's KL trains the indexer of
    the full layer before it through the selection's graph, which does not cross stages: stages
    start only on full-indexer layers (the balanced split keeps to them; an explicit one that does
    not is refused)."""
    args = model.args
    starts = None
    if any(param.requires_grad for name, param in model.named_parameters() if ".indexer." in name):
        starts = frozenset(i for i, kind in enumerate(args.indexer_types) if kind == "full")
        first_layers = [sum(explicit_split[:i]) for i in range(1, len(explicit_split))] if explicit_split else []
        shared = [layer for layer in first_layers if layer not in starts]
        if shared:
            raise ValueError(f"parallel.pp_layer_split {explicit_split} starts a stage on shared-indexer layer(s) "
                             f"{shared}: with model.indexer_trainable their KL trains the indexer of the stage "
                             "before; start every stage on a full-indexer layer "
                             f"({sorted(starts)}) or leave the split to the planner")
    layers_per_stage = plan_stages(layer_costs(args, seq_len), head_cost(args), pp * stages_per_rank, explicit_split,
                                   starts)
    stage_ids = stage_ids_for_rank(schedule, pp_rank, pp, stages_per_rank)
    stages = split_into_stages(model, layers_per_stage, stage_ids, loss_chunk_size, mtp, indexer_kl, distill)
    model.layers_per_stage = layers_per_stage  # for the run's description
    return stages


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipelined run splits and schedules (the `parallel.pp_*` keys, resolved)."""

    schedule: str
    stages_per_rank: int
    microbatches: int  # per micro batch
    micro_batch: int  # rows per micro batch
    seq_len: int  # tokens per packed row
    layer_split: list[int] | None = None  # layers per stage; None = balanced by cost
    dtype: torch.dtype = torch.float32  # the activations' dtype between stages
    device: torch.device | None = None  # where the stages run; None = the model's parameters'
    # train.mtp_loss_weight: > 0, the last stage runs the MTP layer and its loss (the next tokens'
    # embeddings travel with the hidden states: models/glm5/stages.py)
    mtp_loss_weight: float = 0.0
    # train.indexer_loss_weight: > 0, every stage's layers (and the MTP layer, when it runs) compute
    # their indexer's KL loss (models/glm5/stages.py)
    indexer_loss_weight: float = 0.0
    # distill.weight of train.objective distill: > 0, the last stage adds the teacher's KL term to its
    # loss and reports its parts (models/glm5/stages.py)
    distill_weight: float = 0.0
    # parallel.pp_ep_overlap: DualPipeV's paired forward and backward take turns at each expert
    # all-to-all, so one's rows travel while the other computes (glmtune/distributed/paired_overlap.py)
    ep_overlap: bool = False


def parallelize_glm5(
    model: Glm5ForCausalLM,
    *,
    mesh=None,
    activation_checkpointing: str = "none",
    ac_keep_matmul_min_k: int = KEEP_MATMUL_MIN_K,
    compile: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    ep_dispatcher: str = "all_to_all",
    ep_overlap_chunks: int = 1,
    ep_keep_exchanges: str = "none",
    cp_balance: str = "head_tail",
    pipeline: PipelineOptions | None = None,
) -> nn.Module:
    """Apply PP split -> EP -> CP -> AC -> compile -> FSDP2 in that order (see module docstring).

    Args:
        mesh: the run's `ParallelMesh` (glmtune/distributed/mesh.py); None = one process.
        reduce_dtype: what FSDP2 sums gradients in (module docstring).
        ep_dispatcher: token movement under EP (`glmtune.distributed.expert_parallel.DISPATCHERS`).
        ep_overlap_chunks: chunks of each MoE layer's tokens whose all-to-alls overlap the other
            chunks' experts (`TokenDispatcher.overlap_chunks`); > 1 needs EP's all_to_all dispatcher.
        ep_keep_exchanges: "none", "counts", "combine", "dispatch" or "both": the expert all-to-alls whose received rows
            full recomputation takes from the forward instead of exchanging again
            (`glmtune.distributed.exchange_keeper`); needs EP's all_to_all dispatcher, full
            activation checkpointing and no compile.
        cp_balance: which queries each context-parallel rank keeps (`parallel.cp_balance`).
        pipeline: the schedule and split when the mesh has pp > 1; the runner of the built
            `glmtune.distributed.pipeline.Pipeline` is then `model.step_runner` (a
            `PipelinedRunner`; without a pipeline the family's spec runs the whole model).
    """
    stages = None
    if mesh is not None and mesh.size("pp") > 1:
        assert pipeline is not None, "a pipelined mesh needs PipelineOptions"
        stages = split_model(model, pp=mesh.size("pp"), pp_rank=mesh.rank("pp"), schedule=pipeline.schedule,
                             stages_per_rank=pipeline.stages_per_rank, seq_len=pipeline.seq_len,
                             explicit_split=pipeline.layer_split, mtp=pipeline.mtp_loss_weight > 0,
                             indexer_kl=pipeline.indexer_loss_weight > 0, distill=pipeline.distill_weight > 0)
    expert_parallel = mesh is not None and mesh.ep_size > 1
    if ep_overlap_chunks != 1 and not (expert_parallel and ep_dispatcher == "all_to_all" and ep_overlap_chunks > 1):
        raise ValueError(f"ep_overlap_chunks {ep_overlap_chunks}: chunks overlap the all-to-alls of expert "
                         "parallelism, so more than 1 needs ep > 1 with the all_to_all dispatcher")
    _check_kept_exchanges(ep_keep_exchanges, expert_parallel and ep_dispatcher == "all_to_all",
                          activation_checkpointing, compile)
    ep_overlap = stages is not None and pipeline.ep_overlap
    if ep_overlap and not (expert_parallel and ep_dispatcher == "all_to_all" and pipeline.schedule == "DualPipeV"
                           and not compile):
        raise ValueError("pipeline ep_overlap pairs DualPipeV's forwards and backwards at the all-to-alls of expert "
                         "parallelism: it needs the DualPipeV schedule, ep > 1 with the all_to_all dispatcher "
                         "and compile off")
    if expert_parallel:
        apply_expert_parallel(model, mesh.get("ep"), ep_dispatcher)
        for layer in expert_layers(model):
            layer.dispatcher.overlap_chunks = ep_overlap_chunks
            layer.dispatcher.hands_over = ep_overlap
    if mesh is not None and mesh.size("cp") > 1:
        apply_context_parallel(model, mesh.group("cp"), cp_balance)
    if activation_checkpointing != "none":
        apply_activation_checkpointing(model, activation_checkpointing, ac_keep_matmul_min_k, ep_keep_exchanges)
    if compile:
        apply_compile(model)
    if mesh is not None and mesh.degrees.fsdp_applies():
        apply_fsdp(model, mesh.fsdp_mesh(), reduce_dtype,
                   expert_mesh=mesh.expert_fsdp_mesh() if expert_parallel else None, stages=stages)
    if stages is not None:
        queries = pipeline.seq_len // mesh.size("cp")
        model.step_runner = PipelinedRunner(Pipeline(
            stages, stage_ids_for_rank(pipeline.schedule, mesh.rank("pp"), mesh.size("pp"), pipeline.stages_per_rank),
            mesh.size("pp") * pipeline.stages_per_rank, mesh.group("pp"), pipeline.device or _device(model),
            pipeline.schedule,
            pipeline.microbatches, pipeline.micro_batch, pipeline.seq_len, queries, model.args.hidden_size,
            pipeline.dtype, carry_group=mesh.second_pp_group() if _any_carry(model) else None,
            ep_overlap=ep_overlap, whole_backward=activation_checkpointing != "none"), model)
    return model


def _check_kept_exchanges(keep: str, all_to_all: bool, activation_checkpointing: str, compile: bool) -> None:
    if keep not in KEEP_CHOICES:
        raise ValueError(f"ep_keep_exchanges {keep!r}: choose from {KEEP_CHOICES}")
    if keep != "none" and not (all_to_all and activation_checkpointing == "full" and not compile):
        raise ValueError(f"ep_keep_exchanges {keep}: keeps what the expert all-to-alls received for full activation "
                         "checkpointing's recomputation, so it needs ep > 1 with the all_to_all dispatcher, "
                         "activation_checkpointing full and compile off")


def _any_carry(model) -> bool:
    """Whether any stage of the pipeline (not only this rank's) starts on a shared-indexer layer:
    creating the carry group is collective, so every rank must agree (all know the whole split)."""
    split = model.layers_per_stage
    return any(needs_carry(model.args.indexer_types, sum(split[:i])) for i in range(len(split)))


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters())
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.device
