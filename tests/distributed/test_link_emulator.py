"""The link emulator on CPU (glmtune/distributed/link_emulator.py): a loopback collective takes the
link model's time on its group's lane, compute issued meanwhile hides it, a lane runs its
collectives in turn while lanes of different groups overlap, and the time it models is the
transfer estimate's (glmtune/plan/comm.py: one link model).

Timing bounds: a collective never completes before its modeled time (exact: the lane's clock);
the upper bounds allow 2 s of scheduling delay (a loaded 2-core machine wakes a sleeper late, never
early)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from glmtune.cli import main
from glmtune.distributed.link_emulator import emulated_links
from glmtune.distributed.link_model import Links, bytes_sent, collective_seconds
from glmtune.distributed.loopback import join_loopback_world
from glmtune.plan.comm import group_traffic
from glmtune.plan.measure_report import link_floor

CPU = torch.device("cpu")
LATE = 2.0  # seconds a loaded machine may wake a sleeper late


def _links_for(seconds: float, op: str, received: int, n: int) -> Links:
    """Links on which one `op` receiving `received` bytes over n ranks of a node takes `seconds`."""
    return Links(nvlink_gbps=bytes_sent(op, received, n) / seconds / 1e9, fabric_gbps=1.0, latency_us=0.0)


def test_a_collective_takes_the_time_the_link_model_gives_it():
    shard = torch.ones(1000)
    received = 8 * shard.numel() * shard.element_size()
    links = _links_for(0.5, "all_gather", received, 8)
    with join_loopback_world(0, 8), emulated_links(links, CPU) as emulator:
        output = torch.empty(8000)
        started = time.monotonic()
        dist.all_gather_into_tensor(output, shard)  # synchronous: torch waits on the work
        elapsed = time.monotonic() - started
        assert torch.equal(output, torch.ones(8000))  # the stand-in's copies happened
        (lane,) = emulator.lanes.values()
        assert lane.log.seconds == {"all_gather": pytest.approx(0.5)}
    assert 0.5 <= elapsed < 0.5 + LATE
    # the transfer estimate gives the same seconds for the same bytes (one link model)
    (estimate,) = group_traffic("dp_shard", list(range(8)), {"all_gather": received}, links, {"all_gather": 1})
    assert estimate.seconds == pytest.approx(0.5)


def test_latency_counts_each_ring_step_and_links_differ_across_nodes():
    links = Links(nvlink_gbps=100.0, fabric_gbps=10.0, gpus_per_node=4, latency_us=10.0)
    within = collective_seconds("reduce_scatter", 10**9, [0, 1, 2, 3], links)
    assert within == pytest.approx(3e9 / 100e9 + 3 * 10e-6)  # 3 shards sent, 3 ring steps
    across = collective_seconds("all_reduce", 10**9, [0, 4], links, calls=5)
    assert across == pytest.approx(1e9 / 10e9 + 5 * 2 * 10e-6)
    assert collective_seconds("all_gather", 10**9, [3], links) == 0.0


def test_an_all_to_all_across_nodes_reaches_its_own_node_over_nvlink():
    links = Links(nvlink_gbps=100.0, fabric_gbps=10.0, gpus_per_node=4, latency_us=0.0)
    ep16 = list(range(16))  # 4 nodes of 4: of 16 equal parts received, 3 come over NVLink, 12 over the fabric
    assert collective_seconds("all_to_all", 16 * 10**9, ep16, links) == pytest.approx(12e9 / 10e9)
    # within a node it is all NVLink; one rank per node, all fabric: each as a ring would count it
    assert collective_seconds("all_to_all", 4 * 10**9, [0, 1, 2, 3], links) == pytest.approx(3e9 / 100e9)
    assert collective_seconds("all_to_all", 4 * 10**9, [0, 4, 8, 12], links) == pytest.approx(3e9 / 10e9)
    # where NVLink is the slower part it sets the time: 2 ranks per node on a fabric as fast as NVLink
    equal = Links(nvlink_gbps=10.0, fabric_gbps=10.0, gpus_per_node=2, latency_us=0.0)
    assert collective_seconds("all_to_all", 4 * 10**9, [0, 1, 2, 3], equal) == pytest.approx(2e9 / 10e9)


def _busy(at_least: float) -> tuple[float, float]:
    """Matrix products until `at_least` seconds of them have run: (start, end)."""
    a = torch.randn(256, 256)
    start = time.monotonic()
    while time.monotonic() - start < at_least:
        a = torch.tanh(a @ a)
    return start, time.monotonic()


def test_compute_issued_while_a_collective_runs_hides_it():
    modeled = 1.0
    received = 4 * 4096 * 4
    links = _links_for(modeled, "all_gather", received, 4)
    with join_loopback_world(0, 4), emulated_links(links, CPU) as emulator:
        output = torch.empty(4 * 4096)
        started = time.monotonic()
        work = dist.all_gather_into_tensor(output, torch.ones(4096), async_op=True)
        compute_start, compute_end = _busy(modeled / 2)
        work.wait()
        total = time.monotonic() - started
        (lane,) = emulator.lanes.values()
        (lane_start, lane_end), = lane.log.intervals
    computed = compute_end - compute_start
    # they ran at once: the call returned before its hold ended (the lane's clock is exact, so this
    # does not depend on how late a loaded machine wakes a sleeper)
    assert lane_start < compute_end and compute_start < lane_end
    assert total >= modeled
    assert total < max(computed, modeled) + LATE


def test_a_lane_runs_its_collectives_in_turn_and_lanes_of_two_groups_overlap():
    # 1 byte/s: each hold lasts about an hour, so the order below never depends on how fast this machine
    # issues the three calls; nothing waits for the holds (a lane's clock is its intervals).
    links = Links(nvlink_gbps=1e-9, fabric_gbps=1e-9, latency_us=0.0)
    with join_loopback_world(0, 2), emulated_links(links, CPU) as emulator:
        world = dist.group.WORLD
        other = dist.new_group([0, 1])
        for group in (world, world, other):
            dist.all_reduce(torch.ones(512), async_op=True, group=group)
        lanes = {emulator.names[key]: lane.log.intervals for key, lane in emulator.lanes.items()}
    first, second = lanes[world.group_name]
    assert first[1] - first[0] > 1000
    assert second[0] >= first[1]  # in turn on one lane
    (third,) = lanes[other.group_name]
    assert third[0] < first[1]  # the other group's lane did not wait for this one's


def test_measure_with_emulated_links_reports_a_step_that_waits_for_its_links(capsys):
    argv = ["plan", "tiny/sft_support_json", "--measure", "--gpus", "2", "--steps", "1", "--warmup-steps", "0",
            "--emulate-links", "--nvlink-gbps", "0.02", "--link-latency-us", "0", "--json",
            "--data.packed_sequence_size", "128", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    emulated = report["emulated"]
    busiest = max(sum(ops.values()) for ops in emulated["lane_seconds"].values())
    assert busiest > 0.2  # FSDP2's gathers and reduce-scatters over 2 ranks at 20 MB/s
    assert emulated["measured_step_s"] >= busiest  # the step ends after its last collective
    assert report["tokens_per_s_source"] == "emulated links"
    assert report["tokens_per_s_per_gpu"] == pytest.approx(
        report["time"]["tokens_per_micro_batch"] * report["time"]["micro_batches"] / emulated["step_s"], rel=1e-9)
    # the formula's estimate for the same collectives, beside it
    fsdp = sum(c["seconds"] for c in report["comm"] if c["overlapped"])
    assert fsdp == pytest.approx(busiest, rel=1e-6)
    # the floor of these links: the rank's compute or its busiest lane (tests/plan/test_measure_report.py)
    floor_s, bound = link_floor(report["time"]["step_s"], emulated["lane_seconds"])
    assert floor_s >= busiest and emulated["floor_bound"] == bound
    assert emulated["floor_s"] == pytest.approx(floor_s / (1 - emulated["bubble_fraction"]), rel=1e-9)
    assert report["floor_tokens_per_s_per_gpu"] == pytest.approx(
        report["time"]["tokens_per_micro_batch"] * report["time"]["micro_batches"] / emulated["floor_s"], rel=1e-9)


def test_emulate_links_is_an_option_of_measure(capsys):
    assert main(["plan", "tiny/sft_support_json", "--emulate-links"]) == 2
    assert "--emulate-links is an option of --measure" in capsys.readouterr().err
