"""The plan under `parallel.pp_ep_overlap`: a DualPipeV pair's forward computes beside the backward, so
every layer's backward phase also holds one forward's scratch and transients (glmtune/plan/memory.py)."""

from __future__ import annotations

from glmtune.config import load_config
from glmtune.plan.measure import planned_for
from glmtune.plan.planner import degrees_for

DUALPIPEV = ["--parallel.pp_schedule", "DualPipeV", "--parallel.pp_stages_per_rank", "2",
             "--train.micro_batch_size", "16", "--train.global_batch_size", "1024", "--parallel.pp_microbatches", "16"]
PART = "the paired forward's scratch (pp_ep_overlap)"


def _plan(*extra: str):
    cfg = load_config("recipes/glm5/sft_4k.yaml", [*DUALPIPEV, *extra])
    return planned_for(cfg, degrees_for(cfg), 0)


def test_each_backward_phase_holds_the_paired_forwards_scratch():
    plain, paired = _plan(), _plan("--parallel.pp_ep_overlap", "true")
    forward_end = next(p for p in plain.phases if p.name == "forward end").parts
    for before, after in zip(plain.phases, paired.phases, strict=True):
        extra = after.total - before.total
        if after.name.startswith("layer ") and after.name.endswith(" backward"):
            assert extra == after.parts[PART] > 0, after.name
        else:
            assert extra == 0 and PART not in after.parts, after.name
    # the paired peak is a layer's backward; the plain one may be another phase (the MTP layer's backward)
    assert paired.peak.total > plain.peak.total
    same_phase = next(p for p in plain.phases if p.name == paired.peak.name)
    assert paired.peak.total - same_phase.total == paired.peak.parts[PART]
    # The forward's scratch and the family's transients (all-to-all buffers): 2.15 GiB beside a 95.4 GiB peak.
    assert forward_end["forward scratch"] < paired.peak.parts[PART] < 3 * 2**30
