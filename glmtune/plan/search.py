"""The smallest number of GPUs that fits a recipe, and the layout it would use.

GPU counts are tried from one GPU (1, 2, 4 within a node), then in whole nodes
(`gpus_per_node`, 8 by default), doubling. At each count the layouts keep what the recipe fixes about the step (model,
sequence length, micro and global batch, context parallelism, checkpointing, precision,
LoRA) and vary the split: pipeline stages pp in 1, 2, 4, 8 (the recipe's schedule and
stages per rank when pp > 1, otherwise 1F1B), dp_shard filling the rest, and the largest
expert-parallel degree that divides both the experts and dp_shard x cp (experts are most of
GLM-5's bytes; 1 for a dense model). Degrees the model's family does not honour (its
`ModelFamily.limits`: the hf family runs without pipeline or expert parallelism) are not
tried. A layout must pass `glmtune config validate`'s checks; it fits when its planned peak
plus headroom is within the GPU's memory. Among the fitting layouts at the smallest count the
one with the fewest pipeline stages is picked (no bubble to pay).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from glmtune.config import JobConfig
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import model_spec
from glmtune.plan.hardware import GpuSpec
from glmtune.plan.memory import MemoryPlan
from glmtune.plan.planner import degrees_for, plan_memory

GIB = 2**30


@dataclass
class Candidate:
    gpus: int
    layout: dict[str, int]
    plan: MemoryPlan | None
    free_gib: float | None  # after headroom; None when the layout is invalid
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.free_gib is not None and self.free_gib >= 0


def layout_config(cfg: JobConfig, gpus: int, pp: int, ep: int) -> JobConfig:
    """`cfg` at `gpus` GPUs with `pp` stages and `ep`; dp_shard fills the rest."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    per_node = p.gpus_per_node or 8
    if gpus % per_node == 0:  # whole nodes: the launcher (Slurm included) sees the same topology
        p.world_size, p.nodes, p.gpus_per_node = None, gpus // per_node, per_node
    else:
        p.world_size, p.nodes, p.gpus_per_node = gpus, None, None
    p.dp_shard, p.dp_replicate, p.pp, p.ep, p.pp_layer_split = -1, 1, pp, ep, []
    if pp == 1:
        p.pp_schedule, p.pp_stages_per_rank, p.pp_microbatches = "1F1B", 1, None
    elif cfg.parallel.pp == 1:  # the recipe has no pipeline: 1F1B, one microbatch per stage at least
        p.pp_schedule, p.pp_stages_per_rank, p.pp_microbatches = "1F1B", 1, pp
    return out


def _largest_ep(experts: int, sharded: int, honoured: tuple | None) -> int:
    return max((e for e in range(1, min(experts, sharded) + 1)
                if experts % e == 0 and sharded % e == 0 and (honoured is None or e in honoured)), default=1)


def _honoured(spec: ModelSpec, key: str) -> tuple | None:
    """The values of setting `key` the family honours (its `limits`); None: any."""
    return next((values for limit_key, values, _ in spec.family.limits if limit_key == key), None)


def candidates_at(cfg: JobConfig, model: nn.Module, gpus: int, gpu: GpuSpec, context_gib: float,
                  fragmentation: float, one_document: bool) -> list[Candidate]:
    spec = model_spec(cfg.model)
    args = spec.architecture.args_of(model)
    dims = spec.family.dims(args, cfg.model.name_or_path)
    honoured_pp, honoured_ep = _honoured(spec, "parallel.pp"), _honoured(spec, "parallel.ep")
    out = []
    for pp in (1, 2, 4, 8):
        if gpus % (pp * cfg.parallel.cp) or pp > dims.num_layers or (honoured_pp is not None and pp not in honoured_pp):
            continue
        sharded = gpus // pp  # dp_shard x cp
        ep = _largest_ep(dims.num_experts, sharded, honoured_ep)
        layout_cfg = layout_config(cfg, gpus, pp, ep)
        layout = {"pp": pp, "dp_shard": sharded // cfg.parallel.cp, "cp": cfg.parallel.cp, "ep": ep}
        try:
            degrees = degrees_for(layout_cfg, gpus)
        except ValueError as exc:
            out.append(Candidate(gpus, layout, None, None, str(exc).splitlines()[0]))
            continue
        plan = plan_memory(layout_cfg, model, degrees, one_document)
        free = gpu.usable_gib(plan.peak.total / GIB, context_gib, fragmentation)
        out.append(Candidate(gpus, layout, plan, free))
    return out


def smallest_fit(cfg: JobConfig, model: nn.Module, gpu: GpuSpec, context_gib: float, fragmentation: float,
                 one_document: bool = True, max_gpus: int = 2048) -> tuple[Candidate | None, list[Candidate]]:
    """(the picked layout or None, every candidate tried at the count that fits or at the last count)."""
    per_node = cfg.parallel.gpus_per_node or 8
    counts = [n for n in (1, 2, 4) if n < per_node]
    counts += [per_node * 2**k for k in range(12) if per_node * 2**k <= max_gpus]
    tried: list[Candidate] = []
    for gpus in counts:
        tried = candidates_at(cfg, model, gpus, gpu, context_gib, fragmentation, one_document)
        fitting = [c for c in tried if c.fits]
        if fitting:
            return min(fitting, key=lambda c: c.layout["pp"]), tried
    return None, tried
