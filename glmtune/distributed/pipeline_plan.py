"""Which decoder layers each pipeline stage runs, and on which pp rank each stage sits (no torch).

Layers are split into consecutive stages balanced by what they cost to train, not by
count. The costs are the model family's (a list of per-layer costs and the head's extra
cost, which the last stage pays; GLM-5's: `glmtune/models/glm5/stage_costs.py`): this
module knows no model.

`balanced_split` minimises the most expensive stage (exact, by dynamic programming), with
stages starting only where the model allows when it says so (GLM-5.2's trained indexers: on a
layer that runs its own indexer).
`parallel.pp_layer_split` overrides it with an explicit split.

Stage placement follows `torch.distributed.pipelining`: a looped schedule puts stages
r, r + pp, r + 2 pp, ... on pp rank r; the V-shaped ones (ZBVZeroBubble, DualPipeV) put
stages r and 2 pp - 1 - r there.
"""

from __future__ import annotations

from functools import lru_cache

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def balanced_split(costs: list[float], num_stages: int, last_extra: float = 0.0,
                   starts: frozenset[int] | None = None) -> list[int]:
    """Layers per stage, consecutive and at least one each, minimising the costliest stage
    (the last stage also pays `last_extra`); ties go to the split with fewer layers late.
    `starts`: the only layers a stage after the first may start on (None: any)."""
    num_layers = len(costs)
    assert 1 <= num_stages <= num_layers, (num_stages, num_layers)
    if starts is not None and sum(1 for layer in starts if 0 < layer < num_layers) < num_stages - 1:
        raise ValueError(f"only {len(starts)} layers may start a pipeline stage; {num_stages} stages need "
                         f"{num_stages - 1} of them")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    @lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        # layers start.. split into `stages` stages: (costliest stage, sizes)
        if stages == 1:
            return prefix[num_layers] - prefix[start] + last_extra, (num_layers - start,)
        options = []
        for size in range(1, num_layers - start - stages + 2):
            if starts is not None and start + size not in starts:
                continue
            rest, sizes = best(start + size, stages - 1)
            options.append((max(prefix[start + size] - prefix[start], rest), tuple(-s for s in sizes), size, sizes))
        if not options:  # no allowed start leaves room for the remaining stages
            return float("inf"), ()
        worst, _, size, sizes = min(options)
        return worst, (size, *sizes)

    return list(best(0, num_stages)[1])


def plan_stages(layer_costs: list[float], head_cost: float, num_stages: int,
                explicit: list[int] | None = None, starts: frozenset[int] | None = None) -> list[int]:
    """Layers per stage: `explicit` when given (checked by config validation), else balanced by
    cost: `layer_costs` per decoder layer, `head_cost` the last stage's extra (the model's),
    stages starting only on `starts` when the model says so (None: anywhere)."""
    if explicit:
        return list(explicit)
    split = balanced_split(layer_costs, num_stages, head_cost, starts)
    assert len(split) == num_stages and sum(split) == len(layer_costs), split
    return split


def stage_ids_for_rank(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages (in order) that pp rank `pp_rank` runs under `schedule`."""
    if schedule in V_SCHEDULES:
        assert stages_per_rank == 2, schedule
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + s * pp for s in range(stages_per_rank)]


def describe_split(layers_per_stage: list[int]) -> str:
    """"20/20/19/19", or "36 stages of 2-3 layers" when long."""
    if len(layers_per_stage) <= 8:
        return "/".join(map(str, layers_per_stage))
    return f"{len(layers_per_stage)} stages of {min(layers_per_stage)}-{max(layers_per_stage)} layers"
