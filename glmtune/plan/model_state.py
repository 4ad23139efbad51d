"""Model-state bytes: the guide's floor for a whole model, and what one rank holds under a layout.

The model is built on the meta device exactly as `glmtune train` builds it, by its family's
spec (`glmtune/models/registry.py`: preset or HF config, parameter dtype from the precision
rules, FP8 frozen base, LoRA applied), so the parameter list, shapes and dtypes are those of
the run, not a formula; the spec also names each parameter's group and the per-layer costs
the pipeline split is planned from, and its memory model (`ModelSpec.memory`) each parameter's
FSDP unit and whether it is a routed expert.

Per rank, each parameter is placed as the family's parallelization plan (the spec's
`parallelize`) places it:
  * pipeline: decoder layer i lives on the pp rank whose stages hold it (the same split and
    stage assignment as `glmtune/distributed/pipeline.py`); the embedding on stage 0; the
    final norm, LM head and a family's extra layers (GLM-5's MTP) on the last stage;
  * expert parallelism: every parameter of a routed-experts module is split on dim 0 over ep;
  * FSDP2 (whenever the world has more than one rank): routed experts shard over the `efsdp`
    ranks holding the same experts (dim 1 when there are more shards than local experts),
    everything else over `dp_shard x cp`;
    dp_replicate ranks hold copies (HSDP). A shard is `torch.chunk`'s piece: rows
    [r*c, min((r+1)*c, n)) with c = ceil(n / shards), empty past the end (FSDP2's rule).
Gradients exist for trainable parameters, in the parameter's dtype; AdamW keeps two moments
of the same shape and dtype, except under fp32 master weights, where the optimizer holds an fp32
master and two fp32 moments of each trainable bf16 parameter (12 bytes per element; the step
counters are host scalars and are not counted).

Counted bytes are the local shards (`DTensor.to_local()`); FSDP2's padded storage adds at
most one row per tensor per rank.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from glmtune.config import JobConfig
from glmtune.config.degrees import MeshDegrees
from glmtune.distributed.mesh import ParallelMesh
from glmtune.distributed.pipeline_plan import plan_stages, stage_ids_for_rank
from glmtune.models.common.memory_model import MemoryModel
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import model_spec
from glmtune.peft import apply_lora
from glmtune.train.model_source import build_model_from_config
from glmtune.train.precision import resolve_precision

@dataclass
class UnitBytes:
    """One FSDP unit's share on a rank, and what it takes while gathered."""

    params: int = 0  # local shard bytes
    grads: int = 0  # local gradient bytes
    gathered: int = 0  # the unit's parameters unsharded, in the dtype the layers compute in
    trainable_gathered: int = 0  # elements of trainable parameters, unsharded (gradients before reduction)


@dataclass
class StateBytes:
    """Bytes of one rank's (or a whole model's) parameters, gradients and AdamW moments."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    trainable_params: int = 0  # elements
    frozen_params: int = 0  # elements
    by_group: dict[str, int] = field(default_factory=dict)  # parameter bytes per param group
    units: dict[str, UnitBytes] = field(default_factory=dict)  # per FSDP unit (the memory model's `unit_of`)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def add(self, group: str, numel: int, itemsize: int, trainable: bool, masters: bool = False) -> None:
        """`masters`: the optimizer holds an fp32 master and fp32 moments of a narrower parameter."""
        nbytes = numel * itemsize
        self.params += nbytes
        self.by_group[group] = self.by_group.get(group, 0) + nbytes
        if trainable:
            self.grads += nbytes
            self.optimizer += 3 * 4 * numel if masters and itemsize < 4 else 2 * nbytes
            self.trainable_params += numel
        else:
            self.frozen_params += numel

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total,
                "trainable_params": self.trainable_params, "frozen_params": self.frozen_params}


def build_meta_model(cfg: JobConfig) -> nn.Module:
    """The run's model on the meta device: the architecture, dtypes and trainable set of
    `glmtune train` with this config, and no storage (754B parameters cost nothing)."""
    model, _ = build_model_from_config(_readable(cfg), "meta")
    if cfg.model.fp8_base != "none" and not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        model_spec(cfg.model).weights.convert_to_fp8_base(model, cfg.model.fp8_base)  # a preset stands in for an FP8 checkpoint
    # the MTP layer and the indexers train with their losses: their gradients and optimizer state count
    model_spec(cfg.model).compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0,
                                                 indexer=cfg.model.indexer_trainable)
    if cfg.peft.method == "lora":
        apply_lora(model, cfg.peft, seed=cfg.train.seed)
    return model


def _readable(cfg: JobConfig) -> JobConfig:
    """`cfg` with a placeholder model path replaced by its `validate_as` preset (recipes ship
    `/path/to/GLM-5`): the architecture is the preset's, which is what planning needs."""
    m = cfg.model
    if m.validate_as and not (Path(m.name_or_path) / "config.json").is_file():
        cfg = copy.deepcopy(cfg)
        cfg.model.name_or_path = m.validate_as
    return cfg


def memory_model_of(cfg: JobConfig) -> MemoryModel:
    """The recipe's family's memory model; a family without one is refused in one sentence."""
    spec = model_spec(cfg.model)
    if spec.memory is None:
        raise ValueError(f"model {cfg.model.name_or_path}: a memory plan is not available for the {spec.family.name} "
                         "family (its spec gives no memory model)")
    return spec.memory


def _chunk(n: int, shards: int, index: int) -> int:
    """Length of piece `index` of `torch.chunk(range(n), shards)` (0 past the last piece)."""
    size = math.ceil(n / shards) if n else 0
    return max(0, min(size, n - index * size))


def stage_of_unit(unit: str, layer_stage: list[int], last: int) -> int:
    """The pipeline stage holding FSDP unit `unit` (the memory model's `unit_of`)."""
    if unit.startswith("layer."):
        return layer_stage[int(unit.removeprefix("layer."))]
    return 0 if unit == "embed" else last  # final norm, LM head, a family's extra layers (MTP)


def layer_stages(model: nn.Module, cfg: JobConfig, degrees: MeshDegrees) -> tuple[list[int], list[list[int]]]:
    """(stage of each decoder layer, the stages each pp rank runs)."""
    spec = model_spec(cfg.model)
    args, p = spec.architecture.args_of(model), cfg.parallel
    if degrees.pp == 1:
        return [0] * spec.architecture.num_layers(args), [[0]]
    seq_len = cfg.data.packed_sequence_size // degrees.cp
    layer_costs, head_cost = spec.family.stage_costs(args, seq_len)
    split = plan_stages(layer_costs, head_cost, degrees.pp * p.pp_stages_per_rank, p.pp_layer_split or None)
    stage = [s for s, count in enumerate(split) for _ in range(count)]
    ranks = [stage_ids_for_rank(p.pp_schedule, r, degrees.pp, p.pp_stages_per_rank) for r in range(degrees.pp)]
    return stage, ranks


def _after_ep(param: torch.Tensor, experts: bool, degrees: MeshDegrees) -> list[int]:
    shape = list(param.shape)
    if experts and degrees.ep > 1:
        shape[0] //= degrees.ep
    return shape


def _local_numel(param: torch.Tensor, experts: bool, degrees: MeshDegrees, mesh: ParallelMesh,
                 sharded: bool) -> int:
    shape = _after_ep(param, experts, degrees)
    if sharded and shape:
        if experts and degrees.ep > 1:
            shards, index = degrees.efsdp, mesh.rank("efsdp")
            dim = 1 if shards > shape[0] and len(shape) > 1 else 0
        else:
            shards, index = degrees.dp_shard * degrees.cp, mesh.rank("dp_shard_cp")
            dim = 0
        shape[dim] = _chunk(shape[dim], shards, index)
    return math.prod(shape)


def rank_state(model: nn.Module, cfg: JobConfig, degrees: MeshDegrees, rank: int) -> StateBytes:
    """What global rank `rank` holds under `degrees` (module docstring)."""
    mesh = ParallelMesh(degrees, rank=rank)
    stage, stages_of_rank = layer_stages(model, cfg, degrees)
    mine = set(stages_of_rank[mesh.rank("pp")])
    last = max(max(s) for s in stages_of_rank)
    precision = resolve_precision(cfg)
    sharded = degrees.fsdp_applies()
    spec, memory = model_spec(cfg.model), memory_model_of(cfg)
    state = StateBytes()
    for name, param in model.named_parameters():
        unit_name = memory.unit_of(name)
        if degrees.pp > 1 and stage_of_unit(unit_name, stage, last) not in mine:
            continue
        experts = memory.routed_expert(name)
        numel = _local_numel(param, experts, degrees, mesh, sharded)
        state.add(spec.architecture.param_group(name), numel, param.element_size(), param.requires_grad, precision.masters)
        unit = state.units.setdefault(unit_name, UnitBytes())
        unit.params += numel * param.element_size()
        full = math.prod(_after_ep(param, experts, degrees))
        unit.gathered += full * param.element_size()  # FSDP2 gathers in the parameter's dtype (FP8 too)
        if param.requires_grad:
            unit.grads += numel * param.element_size()
            unit.trainable_gathered += full
    return state


def whole_model_state(model: nn.Module, spec: ModelSpec, masters: bool = False) -> StateBytes:
    """Every parameter once, as one process holds it (`spec`: the model's family, `model_spec`,
    which names each parameter's group; `masters`: fp32 master weights in the optimizer)."""
    state = StateBytes()
    for name, param in model.named_parameters():
        state.add(spec.architecture.param_group(name), param.numel(), param.element_size(), param.requires_grad, masters)
    return state
