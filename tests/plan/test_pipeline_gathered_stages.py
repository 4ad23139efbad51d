"""The plan's gathered parameters under a multi-stage pipeline schedule: torch lowers every such
schedule with FSDP2 in mind (`_add_unshard_reshard`: before each action, the next three distinct stages
to compute are gathered and the rest resharded), so a rank holds at most three stages' units gathered,
not every stage's from its forward to its last backward (glmtune/plan/memory.py `_backward_state`,
glmtune/distributed/schedule_order.py `backward_states`).

The figures are the GPU's: `benchmarks/rank_memory_snapshot.py RECIPE --rank R --at-peak` on an H100
(2026-12-07, code of 51ce575; docs/plan.md), the live blocks at the rank's peak that FSDP2's
`alloc_storage` made (each unit's unsharded parameters)."""

from __future__ import annotations

import pytest

from glmtune.config import load_config
from glmtune.distributed.schedule_order import backward_states
from glmtune.plan.measure import planned_for
from glmtune.plan.model_state import build_meta_model, layer_stages, rank_state, stage_of_unit
from glmtune.plan.planner import degrees_for

MEASURED_GATHERED_GIB = [  # (rank, overrides, unsharded parameters live at the peak, GiB)
    (0, [], 4.01),  # stage 0: the embedding and layers 0-2
    (64, [], 4.10),  # three stages of two layers each
    (192, ["--train.mtp_loss_weight", "0"], 5.19),  # the last stage's layer and head, two more stages
    (192, [], 6.01),  # and the MTP layer, which trains
]


@pytest.mark.parametrize(("rank", "overrides", "measured"), MEASURED_GATHERED_GIB)
def test_the_planned_peak_holds_three_stages_gathered_at_most(rank, overrides, measured):
    """At least what the GPU held at its own peak (the plan's peak may be another backward of the step:
    rank 64's is its last, with eight layers gathered) and at most the rank's three largest stages."""
    cfg = load_config("recipes/glm5/sft_4k.yaml", overrides)
    degrees = degrees_for(cfg)
    plan = planned_for(cfg, degrees, rank)
    model = build_meta_model(cfg)
    stage, stages_of_rank = layer_stages(model, cfg, degrees)
    final = max(max(s) for s in stages_of_rank)
    per_stage: dict[int, int] = {}
    for name, unit in rank_state(model, cfg, degrees, rank).units.items():
        per_stage[stage_of_unit(name, stage, final)] = per_stage.get(stage_of_unit(name, stage, final), 0) + unit.gathered
    three_largest = sum(sorted(per_stage.values())[-3:])
    gathered = plan.peak.parts["gathered parameters (kept)"]
    assert measured * 0.99 < gathered / 2**30 and gathered <= three_largest < sum(per_stage.values()) / 2


def test_at_most_three_stages_are_gathered_at_any_backward():
    for rank in range(4):
        states = backward_states("Interleaved1F1B", 4, 9, 4, rank, whole_backward=True)
        assert max(len(gathered) for _, _, gathered, _ in states) == 3
        # a backward's own stage is among them: the lowering gathers it before it computes
        assert all(gathered for _, _, gathered, _ in states)
