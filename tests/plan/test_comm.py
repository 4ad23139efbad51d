"""The transfer estimate of `glmtune plan --measure` (glmtune/plan/comm.py): ring traffic per
collective, the link a group's ranks share, what FSDP2 hides, the pipeline bubble; and the
report's phase rows (glmtune/plan/measure_report.py)."""

from __future__ import annotations

import pytest

from glmtune.plan.comm import Links, bubble_fraction, estimated_step, group_traffic
from glmtune.plan.measure import check_device_holds
from glmtune.plan.measure_report import phase_rows
from glmtune.plan.memory import MemoryPlan, Phase

LINKS = Links(nvlink_gbps=400.0, fabric_gbps=50.0, gpus_per_node=8)


def test_ring_traffic_and_links():
    within = group_traffic("dp_shard", list(range(8)), {"all_gather": 8_000_000_000, "reduce_scatter": 1_000_000_000},
                           LINKS)
    by_op = {t.op: t for t in within}
    assert {t.link for t in within} == {"nvlink"}
    assert by_op["all_gather"].seconds == pytest.approx(8e9 * 7 / 8 / 400e9)  # sends 7 of its 8 slots
    assert by_op["reduce_scatter"].seconds == pytest.approx(1e9 * 7 / 400e9)  # 7 partial shards of its size
    assert all(t.overlapped for t in within)
    across = group_traffic("ep", [0, 8, 16, 24], {"all_to_all": 4_000_000_000, "all_reduce": 100}, LINKS)
    a2a = next(t for t in across if t.op == "all_to_all")
    assert a2a.link == "fabric" and not a2a.overlapped
    assert a2a.seconds == pytest.approx(4e9 * 3 / 4 / 50e9)
    assert group_traffic("pp", [3, 11], {"send": 10**9, "recv": 10**9}, LINKS)[1].seconds == pytest.approx(1e9 / 50e9)
    assert group_traffic("dp_shard", [5], {"all_gather": 10**9}, LINKS)[0].seconds == 0.0  # a group of one moves nothing


def test_a_group_that_serves_ep_and_fsdp_hides_only_fsdp_kinds():
    both = {t.op: t.overlapped for t in group_traffic("ep+dp_shard", list(range(8)),
                                                      {"all_to_all": 10, "all_gather": 10}, LINKS)}
    assert both == {"all_to_all": False, "all_gather": True}
    with_cp = {t.op: t.overlapped for t in group_traffic("cp+dp_shard_cp", [0, 1], {"all_gather": 10}, LINKS)}
    assert with_cp == {"all_gather": False}  # context-parallel gathers sit between computations


def test_step_estimate_and_bubble():
    assert bubble_fraction("1F1B", 1, 8, 1, 0, "full") == 0.0
    assert bubble_fraction("1F1B", 4, 8, 1, 0, "none") == pytest.approx(3 / 11)
    assert bubble_fraction("Interleaved1F1B", 4, 4, 9, 2, "full") == pytest.approx(3 / 39)  # sft_4k's
    # DualPipeV's split backward fills its bubble; run whole under checkpointing, it does not
    split = bubble_fraction("DualPipeV", 4, 16, 2, 0, "none")
    whole = bubble_fraction("DualPipeV", 4, 16, 2, 0, "full")
    assert split < 3 / 35 < whole
    traffic = group_traffic("ep+dp_shard", list(range(8)), {"all_to_all": 800_000_000_000,
                                                           "all_gather": 8_000_000_000_000}, LINKS)
    estimate = estimated_step(10.0, traffic, 0.25)
    exposed = 800e9 * 7 / 8 / 400e9
    hidden = 8e12 * 7 / 8 / 400e9
    assert estimate["exposed_comm_s"] == pytest.approx(exposed)
    assert estimate["fsdp_beyond_compute_s"] == pytest.approx(hidden - 10.0)
    assert estimate["step_s"] == pytest.approx((10.0 + exposed + hidden - 10.0) / 0.75)


def test_phase_rows_take_out_what_a_phase_allocates_once_begun():
    phase = Phase("layer 3 backward", {"parameters": 100, "activations (saved)": 40, "layer 3: saved + recomputed": 7,
                                       "layer 3: backward scratch": 5, "FSDP: gathered parameters": 9,
                                       "MoE all-to-all buffer": 2, "layer 2: nothing": 1})
    plan = MemoryPlan(0, None, phase, [Phase("forward end", {"parameters": 100}), phase], {})
    rows = phase_rows(plan, {"layer 3 backward": 150})
    assert rows == [{"phase": "layer 3 backward", "planned_bytes": 164, "planned_at_start_bytes": 141,
                     "measured_at_start_bytes": 150}]


def test_a_rank_planned_above_the_whole_device_is_refused_before_it_runs():
    plan = MemoryPlan(3, None, Phase("layer 9 backward", {"parameters": 100 << 30}), [], {})
    with pytest.raises(ValueError, match=r"rank 3 plans 100.0 GiB .* this NVIDIA H100 80GB HBM3 has 79.2 GiB"):
        check_device_holds(plan, int(79.2 * 2**30), "NVIDIA H100 80GB HBM3")
    check_device_holds(plan, 101 << 30, "NVIDIA H200")
    check_device_holds(plan, None, "CPU (available memory)")  # unknown: not checked
