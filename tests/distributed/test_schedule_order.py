"""`schedule_order.chunks_in_flight` against real multi-stage schedules: a rank's replica
(`plan --measure`'s `measure_rank`, loopback groups, one process) runs each of torch's schedules with
several stages per rank, and the most forwards its stages hold at once (the stages' cached
forwards, and a split backward's state kept for its weight half) is what the count says, on every
rank, with and without checkpointing (which decides whether a split backward runs whole)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import stage as stage_module

from glmtune.config import load_config
from glmtune.distributed.schedule_order import chunks_in_flight
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for

SHORT = ["--data.packed_sequence_size", "128", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


def _held_at_most(monkeypatch, schedule: str, pp: int, v: int, microbatches: int, checkpointing: str,
                  rank: int) -> int:
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
        *SHORT, "--parallel.pp", str(pp), "--parallel.pp_schedule", schedule, "--parallel.pp_stages_per_rank", str(v),
        "--parallel.pp_microbatches", str(microbatches), "--train.micro_batch_size", str(microbatches),
        "--train.global_batch_size", str(microbatches * pp), "--parallel.activation_checkpointing", checkpointing,
        "--model.overrides.num_hidden_layers", str(v * pp)])
    measure_rank(cfg, degrees_for(cfg, pp), rank, steps=1, warmup=0)
    return peak[0]


V_SHAPED = ["DualPipeV", "ZBVZeroBubble"]
LOOPED = ["Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"]
CASES = [(s, 2, 2, 4, "full") for s in V_SHAPED + LOOPED] + [(s, 3, 2, 6, "full") for s in V_SHAPED + LOOPED] + [
    (s, 3, 2, 6, "none") for s in V_SHAPED + ["InterleavedZeroBubble"]] + [(s, 2, 3, 6, "full") for s in LOOPED]


@pytest.mark.parametrize(("schedule", "pp", "v", "microbatches", "checkpointing"), CASES)
def test_each_rank_holds_what_the_schedule_order_says(monkeypatch, schedule, pp, v, microbatches, checkpointing):
    counts = [chunks_in_flight(schedule, pp, v, microbatches, rank, whole_backward=checkpointing != "none")
              for rank in range(pp)]
    held = [_held_at_most(monkeypatch, schedule, pp, v, microbatches, checkpointing, rank) for rank in range(pp)]
    assert held == counts


def test_the_orders_differ_from_the_interleaved_formula_at_pp4():
    # Interleaved1F1B's (v - 1) pp + 2 (pp - 1 - r) + 1 is 11, 9, 7, 5 here; the others hold otherwise
    def counts(schedule, whole_backward=True):
        return [chunks_in_flight(schedule, 4, 2, 16, rank, whole_backward) for rank in range(4)]

    assert counts("Interleaved1F1B") == [11, 9, 7, 5]
    assert counts("DualPipeV") == [9] * 4
    assert counts("ZBVZeroBubble") == [8] * 4
    assert counts("InterleavedZeroBubble") == [8, 7, 6, 5]
    assert counts("InterleavedZeroBubble", whole_backward=False) == [8, 8, 8, 8]
