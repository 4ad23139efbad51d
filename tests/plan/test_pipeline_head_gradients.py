"""The fused losses' head weight gradients on a pipeline's last rank: each fused loss (the main one and,
with GLM-5's MTP loss, the MTP layer's) computes its [V, D] weight gradient in forward and keeps it until
its backward, so a last-stage chunk in flight holds one per loss through the other stages' backwards.
Measured on an H100 (2026-12-07, `benchmarks/rank_memory_snapshot.py recipes/glm5/sft_4k.yaml --rank 192
--at-peak`, docs/plan.md): 3.54 GiB from the fused loss at rank 192's peak with the MTP loss, 1.77 without."""

from __future__ import annotations

import pytest

from glmtune.config import load_config
from glmtune.plan.measure import planned_for
from glmtune.plan.planner import degrees_for

HEAD_GRADIENTS = ("head weight gradient (from the fused loss)", "MTP head weight gradient (its fused loss)")


@pytest.mark.parametrize(("weight", "measured_gib"), [("0", 1.77), ("0.3", 3.54)])
def test_the_last_rank_holds_each_fused_loss_head_gradient_at_its_peak(weight, measured_gib):
    cfg = load_config("recipes/glm5/sft_4k.yaml", ["--train.mtp_loss_weight", weight])
    plan = planned_for(cfg, degrees_for(cfg), 192)
    assert plan.peak.name.startswith("layer ")  # a decoder layer's backward, the other stages'
    held = sum(plan.peak.parts.get(name, 0) for name in HEAD_GRADIENTS)
    assert abs(held / 2**30 - measured_gib) < 0.01 * measured_gib

