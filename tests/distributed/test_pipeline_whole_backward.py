"""Under activation checkpointing the zero-bubble schedules run each backward whole in its input
half (`pipeline.Pipeline`'s `whole_backward`): a rank's replica (`measure_rank`, loopback groups)
of a pp 2 x ep 2 layout exchanges as many expert rows per step under DualPipeV and ZBVZeroBubble as
under Interleaved1F1B, each checkpointed layer recomputed once (torch's split recomputed them again
in the weight half: 2.2x and 6x the rows before). Without checkpointing the split is kept."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import _backward, stage as stage_module

from glmtune.config import load_config
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for

SHORT = ["--data.packed_sequence_size", "256", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


def _rank0(monkeypatch, schedule: str, checkpointing: str) -> tuple[int, int]:
    """(expert all-to-all bytes rank 0 receives in a step, weight-half backwards it ran)."""
    weight_halves = [0]
    weight = _backward.stage_backward_weight

    def counting_weight(*args, **kwargs):
        weight_halves[0] += 1
        return weight(*args, **kwargs)

    monkeypatch.setattr(stage_module, "stage_backward_weight", counting_weight)
    cfg = load_config("tiny/sft_support_json", [
        *SHORT, "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_schedule", schedule,
        "--parallel.pp_stages_per_rank", "2", "--parallel.pp_microbatches", "4", "--train.micro_batch_size", "4",
        "--train.global_batch_size", "8", "--parallel.activation_checkpointing", checkpointing])
    replica = measure_rank(cfg, degrees_for(cfg, 4), 0, steps=1, warmup=0)
    return replica.comm_bytes["ep"]["bytes"]["all_to_all"], weight_halves[0]


@pytest.mark.parametrize("schedule", ["DualPipeV", "ZBVZeroBubble"])
def test_split_schedules_recompute_each_layer_once_under_checkpointing(monkeypatch, schedule):
    looped, _ = _rank0(monkeypatch, "Interleaved1F1B", "full")
    exchanged, weight_halves = _rank0(monkeypatch, schedule, "full")
    assert exchanged == looped
    assert weight_halves == 0


def test_without_checkpointing_the_split_is_kept(monkeypatch):
    _, weight_halves = _rank0(monkeypatch, "ZBVZeroBubble", "none")
    assert weight_halves > 0
