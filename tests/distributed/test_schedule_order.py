"""`schedule_order` against torch. `chunks_in_flight` against real multi-stage schedules: a rank's replica
(`plan --measure`'s `measure_rank`, loopback groups, one process) runs each of torch's schedules with
several stages per rank, and the most forwards its stages hold at once (the stages' cached
forwards, and a split backward's state kept for its weight half) is what the count says, on every
rank, with and without checkpointing (which decides whether a split backward runs whole); so are the
states each backward starts in (`backward_states`: what is held, which stages are part-way through
their microbatches' backwards).
`idle_fractions` against torch's own simulation of a schedule (its visualizer's spacing, at its unit
costs) and Megatron's interleaved bubble."""

from __future__ import annotations

import contextlib
import io

import pytest
from torch.distributed.pipelining import _schedule_visualizer, schedules as schedules_module, stage as stage_module

from glmtune.config import load_config
from glmtune.distributed.schedule_order import ActionCosts, backward_states, chunks_in_flight, idle_fractions
from glmtune.plan.measure import measure_rank
from glmtune.plan.planner import degrees_for

_STAGE_FORWARD = stage_module._PipelineStageBase.forward_one_chunk
_STAGE_BACKWARD = stage_module._PipelineStageBase.backward_one_chunk
_RUNTIME_STEP = schedules_module._PipelineScheduleRuntime._step_microbatches
SHORT = ["--data.packed_sequence_size", "128", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


def _observed(monkeypatch, schedule: str, pp: int, v: int, microbatches: int, checkpointing: str,
              rank: int) -> tuple[int, set]:
    """The most forwards rank `rank`'s stages held at once, and the distinct (held, stages part-way
    through their microbatches' backwards, stages gathered, stages done with the step's backwards) as
    each backward started, in a replica run. Gathered: the stages whose FSDP2 units the running
    schedule has unsharded or is unsharding (its own record of the UNSHARD and RESHARD actions it ran)."""
    stages, peak, states, done, runtime = [], [0], set(), {}, []
    # torch's own, not an earlier rank's counting ones
    forward, backward, step_microbatches = _STAGE_FORWARD, _STAGE_BACKWARD, _RUNTIME_STEP

    def held() -> int:
        return sum(len(s.fwd_cache) + len(s.backward_state) for s in stages)

    def counting_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self not in stages:
            stages.append(self)
        peak[0] = max(peak[0], held())
        return out

    def counting_backward(self, *args, **kwargs):
        schedule = runtime[-1]
        gathered = frozenset(schedule.unsharded_stages) | frozenset(schedule.unshard_ops)
        states.add((held(), frozenset(k for k, n in done.items() if 1 <= n < microbatches), gathered,
                    frozenset(k for k, n in done.items() if n == microbatches)))
        done[self.stage_index] = done.get(self.stage_index, 0) + 1
        return backward(self, *args, **kwargs)

    def step(self, *args, **kwargs):  # measure_rank runs the step more than once: the counts restart
        runtime.append(self)
        done.clear()
        return step_microbatches(self, *args, **kwargs)

    monkeypatch.setattr(stage_module._PipelineStageBase, "forward_one_chunk", counting_forward)
    monkeypatch.setattr(stage_module._PipelineStageBase, "backward_one_chunk", counting_backward)
    monkeypatch.setattr(schedules_module._PipelineScheduleRuntime, "_step_microbatches", step)
    cfg = load_config("tiny/sft_support_json", [
        *SHORT, "--parallel.pp", str(pp), "--parallel.pp_schedule", schedule, "--parallel.pp_stages_per_rank", str(v),
        "--parallel.pp_microbatches", str(microbatches), "--train.micro_batch_size", str(microbatches),
        "--train.global_batch_size", str(microbatches * pp), "--parallel.activation_checkpointing", checkpointing,
        "--model.overrides.num_hidden_layers", str(v * pp)])
    measure_rank(cfg, degrees_for(cfg, pp), rank, steps=1, warmup=0)
    return peak[0], states


V_SHAPED = ["DualPipeV", "ZBVZeroBubble"]
LOOPED = ["Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"]
# pp 3 is the smallest pipeline where the V schedules' counts leave the interleaved formula; without
# checkpointing InterleavedZeroBubble keeps a split chunk to its weight half (6 on every rank, not 6, 5, 4)
CASES = [(s, 3, 2, 6, "full") for s in V_SHAPED + LOOPED] + [
    (s, 3, 2, 6, "none") for s in ["DualPipeV", "InterleavedZeroBubble"]] + [("Interleaved1F1B", 2, 3, 6, "full")]


@pytest.mark.parametrize(("schedule", "pp", "v", "microbatches", "checkpointing"), CASES)
def test_each_rank_holds_what_the_schedule_order_says(monkeypatch, schedule, pp, v, microbatches, checkpointing):
    whole = checkpointing != "none"
    observed = [_observed(monkeypatch, schedule, pp, v, microbatches, checkpointing, rank) for rank in range(pp)]
    assert [peak for peak, _ in observed] == [chunks_in_flight(schedule, pp, v, microbatches, rank, whole)
                                            for rank in range(pp)]
    assert [states for _, states in observed] == [set(backward_states(schedule, pp, v, microbatches, rank, whole))
                                                  for rank in range(pp)]


def test_the_orders_differ_from_the_interleaved_formula_at_pp4():
    # Interleaved1F1B's (v - 1) pp + 2 (pp - 1 - r) + 1 is 11, 9, 7, 5 here; the others hold otherwise
    def counts(schedule, whole_backward=True):
        return [chunks_in_flight(schedule, 4, 2, 16, rank, whole_backward) for rank in range(4)]

    assert counts("Interleaved1F1B") == [11, 9, 7, 5]
    assert counts("DualPipeV") == [9] * 4
    assert counts("ZBVZeroBubble") == [8] * 4
    assert counts("InterleavedZeroBubble") == [8, 7, 6, 5]
    assert counts("InterleavedZeroBubble", whole_backward=False) == [8, 8, 8, 8]


MULTI_STAGE = ["Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("schedule", MULTI_STAGE)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (3, 6), (4, 16)])
def test_a_step_spans_what_torchs_own_simulation_gives(schedule, pp, microbatches):
    # torch's visualizer spaces every rank's actions by their dependencies, a forward, an input or a
    # weight half taking 1 step, a whole backward 2, a DualPipeV pair 3 (and prints as it goes)
    with contextlib.redirect_stdout(io.StringIO()):
        spaced = _schedule_visualizer.get_schedule_ops(schedule, pp, microbatches, 2, add_spacing=True)
    width = _schedule_visualizer.action_type_to_color_mapping
    ends = []
    for actions in spaced:
        while actions and actions[-1] is None:
            actions = actions[:-1]
        ends.append(sum(1 if a is None else width[a.computation_type].width for a in actions))
    idle = idle_fractions(schedule, pp, 2, microbatches, whole_backward=False, costs=ActionCosts(1.0, 2.0, 0.0))
    busy = 2 * microbatches * 3  # two stages' forwards and backwards
    assert [busy / (1 - share) for share in idle] == pytest.approx([max(ends)] * pp)


@pytest.mark.parametrize("pp,v,microbatches", [(2, 2, 4), (4, 2, 8), (4, 9, 4), (4, 9, 8), (8, 4, 16)])
def test_interleaved_idles_megatrons_bubble(pp, v, microbatches):
    # Narayanan et al. 2021: (p - 1) / (v m + p - 1) of an interleaved step, whatever the costs
    for costs in (ActionCosts(), ActionCosts(recompute=1.0)):
        idle = idle_fractions("Interleaved1F1B", pp, v, microbatches, True, costs)
        assert idle == pytest.approx([(pp - 1) / (v * microbatches + pp - 1)] * pp)


def test_a_whole_backward_leaves_the_zero_bubble_schedules_their_bubble():
    for schedule in ("ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"):
        split = idle_fractions(schedule, 4, 2, 16, False, ActionCosts(recompute=1.0))
        whole = idle_fractions(schedule, 4, 2, 16, True, ActionCosts(recompute=1.0))
        assert max(split) < min(whole)
