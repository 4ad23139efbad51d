"""`schedule_order.chunks_in_flight` against real V schedules: a rank's replica (`plan --measure`'s
`measure_rank`, loopback groups, one process) runs torch's ZBVZeroBubble and DualPipeV, and the
most forwards its stages hold at once (the stages' cached forwards, and a split backward's state
kept for its weight half) is what the count says, on every rank."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import stage as stage_module

from glmtune.config import load_config
from glmtune.distributed.schedule_order import chunks_in_flight
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for

SHORT = ["--data.packed_sequence_size", "128", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


def _held_at_most(monkeypatch, pp: int, microbatches: int, schedule: str, checkpointing: str, rank: int) -> int:
    stages, peak = [], [0]
    forward = stage_module._PipelineStageBase.forward_one_chunk

    def counting_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self not in stages:
            stages.append(self)
        peak[0] = max(peak[0], sum(len(s.fwd_cache) + len(s.backward_state) for s in stages))
        return out

    monkeypatch.setattr(stage_module._PipelineStageBase, "forward_one_chunk", counting_forward)
    cfg = load_config("tiny/sft_support_json", [
        *SHORT, "--parallel.pp", str(pp), "--parallel.pp_schedule", schedule, "--parallel.pp_stages_per_rank", "2",
        "--parallel.pp_microbatches", str(microbatches), "--train.micro_batch_size", str(microbatches),
        "--train.global_batch_size", str(microbatches * pp), "--parallel.activation_checkpointing", checkpointing,
        "--model.overrides.num_hidden_layers", str(2 * pp)])
    measure_rank(cfg, degrees_for(cfg, pp), rank, steps=1, warmup=0)
    return peak[0]


@pytest.mark.parametrize("schedule", ["DualPipeV", "ZBVZeroBubble"])
@pytest.mark.parametrize("pp,microbatches,checkpointing", [(2, 4, "full"), (3, 7, "full"), (3, 6, "none")])
def test_each_rank_holds_what_the_schedule_order_says(monkeypatch, schedule, pp, microbatches, checkpointing):
    counts = [chunks_in_flight(schedule, pp, microbatches, rank) for rank in range(pp)]
    held = [_held_at_most(monkeypatch, pp, microbatches, schedule, checkpointing, rank) for rank in range(pp)]
    assert held == counts


def test_the_v_schedules_keep_as_many_chunks_on_every_rank_at_pp4():
    # the looped formula would give 11, 9, 7, 5: the V schedules' first rank holds fewer, the last more
    assert [chunks_in_flight("DualPipeV", 4, 16, rank) for rank in range(4)] == [9] * 4
    assert [chunks_in_flight("ZBVZeroBubble", 4, 16, rank) for rank in range(4)] == [8] * 4
