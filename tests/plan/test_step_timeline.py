"""The emulated steps' timeline (glmtune/plan/step_timeline.py): compute beside the links' lanes, whole
and per pipeline action, from a profile's kernels and host ranges. A GPU's profile is not at hand on a
CPU, so the records are written here with known intervals and the figures checked to the microsecond;
a real CPU profile's schedule ranges are read by the same `records`."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import record_function

from glmtune.distributed.link_emulator import LANE_RANGE, HostLane
from glmtune.plan.step_profile import profiled
from glmtune.plan.step_timeline import (HostRange, Kernel, action_kind, compute_stream, held_within, merged, records,
                                        timeline, timeline_table)

SPIN = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
COMPUTE, LANE, SIDE = 7, 9, 3


def _records():
    kernels = [
        Kernel("gemm", COMPUTE, 0, 10, launched=1),  # PP:0F0's
        Kernel("gemm", COMPUTE, 20, 30, launched=3),  # the pair's, after a wait for the lane's transfer
        Kernel("copy", COMPUTE, 30, 40, launched=7),
        Kernel("gemm", COMPUTE, 50, 60, launched=8.5),  # PP:1B1's, after a wait no lane explains
        Kernel("gemm", COMPUTE, 60, 61, launched=None),  # a launch the profile could not link: "other"
        Kernel("gemm", COMPUTE, 70, 72, launched=68),  # PP:1B2's, launched after the stream went idle
        Kernel("Memcpy DtoD", LANE, 4, 5, launched=2.5),  # a stand-in's copy on the lane: not compute
        Kernel(SPIN, LANE, 5, 25, launched=2.6),  # a transfer modeled at 20 us
        Kernel("memset", SIDE, 0, 1, launched=0.5),
    ]
    actions = [HostRange("PP:0F0", 0, 2), HostRange("PP:(0F1;1B0)OVERLAP_F_B", 2, 8), HostRange("PP:1B1", 8, 9),
               HostRange("PP:1B2", 67, 69), HostRange("PP:marked", 0, 9)]  # the last is not the schedule's
    calls = [HostRange("cudaStreamSynchronize", 3, 4), HostRange("cudaLaunchKernel", 1, 1.5),
             HostRange("cudaLaunchKernel", 68, 68.25), HostRange("cudaFree", 40, 43),
             # a `.cpu()`'s copy into pageable memory waits for the stream: a sync; a device copy does not
             HostRange("cudaMemcpyAsync DtoH (Device -> Pageable)", 5, 7),
             HostRange("cudaMemcpyAsync DtoD (Device -> Device)", 2.5, 2.6)]
    return kernels, actions, calls


def test_intervals():
    assert merged([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    lanes = [(0, 4), (5, 9), (12, 13)]
    starts = [start for start, _ in lanes]
    assert held_within(lanes, starts, 3, 10) == 5 and held_within(lanes, starts, 9, 12) == 0
    assert held_within(lanes, starts, -5, 20) == 9 and held_within(lanes, starts, 6, 7) == 1


@pytest.mark.parametrize(("name", "kind"), [
    ("PP:0F3", "F"), ("PP:12B7", "B"), ("PP:(0F3;1B2)OVERLAP_F_B", "OVERLAP_F_B"), ("PP:1SEND_F2", "SEND_F"),
    ("PP:2UNSHARD", "UNSHARD"), ("PP:marked", None), ("aten::mm", None),
])
def test_a_pipeline_actions_kind(name, kind):
    assert action_kind(name) == kind


def test_each_microsecond_is_charged_to_the_action_whose_kernel_ends_it():
    figures = timeline(*_records(), steps=2)
    us = 1e-6 / 2  # a microsecond, per step of two
    assert figures["compute_stream"] == str(COMPUTE)  # the lane's stand-in copy and spin are not compute
    zero = dict.fromkeys(("compute", "hidden", "wait_link", "wait_host", "wait_other", "tail"), 0.0)
    actions = figures["actions"]
    assert sorted(actions) == ["B", "F", "OVERLAP_F_B", "other"]
    assert actions["F"] == pytest.approx({**zero, "compute": 10 * us, "hidden": 5 * us, "actions": 0.5,
                                          "host": 2 * us, "syncs": 0, "sync_seconds": 0})
    # 10-20: the stream idle with the lane holding, the pair's kernel launched long before
    assert actions["OVERLAP_F_B"] == pytest.approx({**zero, "compute": 20 * us, "hidden": 5 * us,
                                                    "wait_link": 10 * us, "actions": 0.5, "host": 6 * us,
                                                    "syncs": 1.0, "sync_seconds": 3 * us})
    # 40-50 idle with nothing holding; 61-70 idle before PP:1B2's operator started (68)
    assert actions["B"] == pytest.approx({**zero, "compute": 12 * us, "wait_other": 10 * us, "wait_host": 9 * us,
                                          "actions": 1.0, "host": 3 * us, "syncs": 0, "sync_seconds": 0})
    assert actions["other"]["compute"] == pytest.approx(1 * us) and actions["other"]["actions"] == 0
    whole = figures["whole"]
    assert whole == pytest.approx({"compute": 43 * us, "hidden": 10 * us, "wait_link": 10 * us, "wait_host": 9 * us,
                                   "wait_other": 10 * us, "tail": 0, "span": 72 * us, "lane_hold": 20 * us,
                                   "syncs": 1.0, "sync_seconds": 3 * us})
    charged = sum(whole[name] for name in ("compute", "wait_link", "wait_host", "wait_other", "tail"))
    assert charged == pytest.approx(whole["span"])  # the window, cut and charged once
    table = timeline_table(figures).splitlines()
    assert table[0].startswith("compute stream 7") and "lanes held" in table[0]
    assert table[1] == f"lanes: stream {LANE} held 0.0000, hidden 0.0000 (50%)"
    assert [line.split()[0] for line in table[3:-1]] == ["whole", "B", "F", "OVERLAP_F_B", "other"]
    # every CUDA call's host time, heaviest first: a free that synchronizes shows
    assert figures["host_calls"] == {
        "cudaFree": {"count": 0.5, "seconds": pytest.approx(3 * us)},
        "cudaMemcpyAsync DtoH (Device -> Pageable)": {"count": 0.5, "seconds": pytest.approx(2 * us)},
        "cudaStreamSynchronize": {"count": 0.5, "seconds": pytest.approx(1 * us)},
        "cudaLaunchKernel": {"count": 1.0, "seconds": pytest.approx(0.75 * us)},
        "cudaMemcpyAsync DtoD (Device -> Device)": {"count": 0.5, "seconds": pytest.approx(0.1 * us)}}
    assert table[-1].startswith("host CUDA calls per step, heaviest: cudaFree ")
    # no lane ranges given: the lane is named by its stream
    assert figures["lanes"] == {f"stream {LANE}": pytest.approx({"held": 20 * us, "hidden": 10 * us})}


def test_each_lane_apart_named_by_the_range_its_spin_was_launched_in():
    """FSDP's lane beside the expert all-to-all's: each its own hold and hidden part, whichever lane
    the stream idles for."""
    ep, fsdp, unnamed, pp = 9, 11, 13, 15
    kernels = [Kernel("gemm", COMPUTE, 0, 10, launched=1), Kernel("gemm", COMPUTE, 20, 30, launched=3),
               Kernel(SPIN, ep, 5, 25, launched=2.6), Kernel(SPIN, ep, 50, 60, launched=4),
               Kernel(SPIN, fsdp, 12, 18, launched=11),  # wholly in the stream's idle gap
               Kernel(SPIN, fsdp, 26, 28, launched=None),  # a launch the profile could not link: the stream's name
               Kernel(SPIN, unnamed, 40, 44, launched=39),
               Kernel(SPIN, pp, 62, 63, launched=None)]  # named by the range the profiler put on its stream
    lanes = [HostRange(LANE_RANGE + "ep", 2.5, 2.7), HostRange(LANE_RANGE + "ep", 3.9, 4.1),
             HostRange(LANE_RANGE + "dp_shard", 10.9, 11.1), Kernel(LANE_RANGE + "pp", pp, 62, 63, None)]
    figures = timeline(kernels, [], [], 1, lanes)
    us = 1e-6
    assert figures["lanes"] == {"ep": pytest.approx({"held": 30 * us, "hidden": 10 * us}),
                                "dp_shard": pytest.approx({"held": 8 * us, "hidden": 2 * us}),
                                f"stream {unnamed}": pytest.approx({"held": 4 * us, "hidden": 0}),
                                "pp": pytest.approx({"held": 1 * us, "hidden": 0})}
    assert figures["whole"]["lane_hold"] == pytest.approx(37 * us)  # the union: 5-25, 26-28, 40-44, 50-60, 62-63
    line = timeline_table(figures).splitlines()[1]
    assert line.startswith("lanes: dp_shard held 0.0000, hidden 0.0000 (25%); ep held") and "(33%)" in line
    assert "; pp held 0.0000, hidden 0.0000 (0%); stream 13 held" in line


def test_no_kernels_no_figures():
    assert timeline([], [], [], steps=1) == {"compute_stream": None, "whole": {}, "actions": {}, "host_calls": {},
                                             "lanes": {}}


def test_a_profiles_schedule_ranges_are_read_and_a_cpu_profile_has_no_kernels():
    """`records` on a real (CPU) profile: the schedule's ranges are its actions, a range of anyone else's
    is not, and there are no kernels, so no timeline (a GPU's profile is read the same way)."""
    a = torch.randn(32, 32)
    lane = HostLane("ep")
    with profiled(torch.device("cpu"), with_stack=False) as prof:
        for name in ("PP:0F0", "PP:(0F1;1B0)OVERLAP_F_B", "mine"):
            with record_function(name):
                a = torch.mm(a, a).tanh()
                lane.submit("all_to_all", lambda: None, 0.0, None, []).wait()  # a collective on the "ep" lane
    kernels, actions, calls, lanes = records(prof)
    assert kernels == [] and calls == []
    assert [a.name for a in actions] == ["PP:0F0", "PP:(0F1;1B0)OVERLAP_F_B"]
    assert all(a.end > a.start for a in actions) and actions[0].end <= actions[1].start
    assert [r.name for r in lanes] == [LANE_RANGE + "ep"] * 3
    assert timeline(kernels, actions, calls, steps=1)["compute_stream"] is None


def test_the_compute_stream_is_not_a_lane_that_holds_longer():
    """An emulated link's lane can hold its stream longer than the rank computes (sft_4k rank 0 under
    DualPipeV held 8.4 s beside 10.2 s of compute): the spin kernels' stream is never the compute stream,
    the summary's or the timeline's."""
    timed = [("gemm", COMPUTE, 5.0), (SPIN, LANE, 9.0), ("Memcpy DtoD", LANE, 1.0), ("memset", SIDE, 1.0)]
    assert compute_stream(timed) == COMPUTE
    assert compute_stream([(SPIN, LANE, 9.0)]) is None and compute_stream([]) is None
