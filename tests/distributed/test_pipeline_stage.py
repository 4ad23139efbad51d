"""Where a pipelined FSDP2 stage reduce-scatters its gradients (glmtune/distributed/pipeline_stage.py):
inside its last backward (FSDP2's hooks, as each unit's backward ends), not after it. One rank of a
pp 2 x dp_shard 2 layout, run in this process on loopback groups (`measure_rank`). That the values are
unchanged is the layout tests' (tests/distributed/test_pipeline_train.py and the others equal one
process)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from glmtune.config import load_config
from glmtune.distributed.pipeline_stage import ReducingStage
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for

SHORT = ["--data.packed_sequence_size", "128", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


def _reduce_scatters_by_phase(monkeypatch, backward) -> dict[str, int]:
    """Rank 0's gradient reduce-scatters in one step, counted by where they were issued: in a
    stage's last backward, in another backward, or after them (torch's REDUCE_GRAD action)."""
    phase, counts = ["outside"], {}

    def in_backward(self, backward_type, bwd_kwargs, last_backward=False):
        phase.append("last backward" if last_backward else "backward")
        try:
            return backward(self, backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            phase.pop()

    reduce_grad = PipelineStage.perform_reduce_grad

    def in_reduce_grad(self, *args, **kwargs):
        phase.append("reduce_grad")
        try:
            return reduce_grad(self, *args, **kwargs)
        finally:
            phase.pop()

    def counting(reduce_scatter):
        def counted(*args, **kwargs):
            if kwargs.get("group", None) is not None and dist.get_world_size(kwargs["group"]) > 1:
                counts[phase[-1]] = counts.get(phase[-1], 0) + 1
            return reduce_scatter(*args, **kwargs)
        return counted

    monkeypatch.setattr(ReducingStage, "backward_maybe_with_nosync", in_backward)
    monkeypatch.setattr(PipelineStage, "perform_reduce_grad", in_reduce_grad)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # FSDP2's call: torch 2.13's name, 2.11's
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, counting(getattr(dist, name)))
    cfg = load_config("tiny/sft_support_json", [
        *SHORT, "--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_stages_per_rank",
        "2", "--parallel.pp_microbatches", "2", "--train.micro_batch_size", "2", "--train.global_batch_size", "4"])
    measure_rank(cfg, degrees_for(cfg, 4), 0, steps=1, warmup=0)
    return counts


@pytest.mark.skipif(not hasattr(PipelineStage, "perform_reduce_grad"), reason="torch < 2.9 has no REDUCE_GRAD")
def test_a_stage_reduce_scatters_during_its_last_backward_where_torch_waits_for_the_end(monkeypatch):
    ours = _reduce_scatters_by_phase(monkeypatch, ReducingStage.backward_maybe_with_nosync)
    monkeypatch.undo()
    # the control: torch's own stage leaves every reduce-scatter to the REDUCE_GRAD action
    torchs = _reduce_scatters_by_phase(monkeypatch, PipelineStage.backward_maybe_with_nosync)
    assert set(ours) == {"last backward"} and set(torchs) == {"reduce_grad"}, (ours, torchs)
    assert ours["last backward"] == torchs["reduce_grad"] > 0  # the same collectives, issued earlier
