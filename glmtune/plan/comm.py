"""The time a measured rank's collectives would take on a real cluster: an estimate, said so.

`glmtune plan --measure` runs one rank with local stand-ins for its collectives
(`glmtune.distributed.loopback`), which count the bytes each group's collectives receive in a
step. This module turns those bytes into seconds with a stated model:

  * bandwidth: a group whose ranks share a node uses NVLink, one that spans nodes the
    inter-node fabric (`Links`; defaults for H100/H200 nodes: NVLink 4 through NVSwitch at an
    NCCL bus bandwidth of 360 GB/s, one 400 Gb/s NIC per GPU at 40 GB/s). Ranks fill nodes in
    order (global rank // GPUs per node), as torchrun and srun place them;
  * traffic per rank, ring algorithms: an all-gather sends (n-1)/n of its output, a
    reduce-scatter (n-1) times its output (one shard), an all-reduce 2(n-1)/n of its tensor, an
    all-to-all (n-1)/n of what it receives, a send or receive its bytes;
  * overlap: FSDP2's all-gathers and reduce-scatters (the dense and expert FSDP axes and HSDP's
    replica all-reduce) run on their own streams while layers compute, so they cost only what
    exceeds the compute; the expert all-to-all, context-parallel gathers and pipeline transfers
    sit between computations and are counted in full;
  * pipeline bubble: a schedule of m micro-batches over p stages with v stages per rank idles
    (p - 1) / (v m + p - 1) of the step (1F1B and interleaved alike), added to the step.

Latency (a collective's fixed cost, ~10-50 us, times the number of collectives) is not
counted; at GLM-5's sizes the bytes dominate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Axes whose collectives FSDP2 issues (overlapped with compute).
FSDP_AXES = frozenset({"dp_shard", "dp_shard_cp", "efsdp", "dp_replicate"})


@dataclass(frozen=True)
class Links:
    nvlink_gbps: float = 360.0  # GB/s of NCCL bus bandwidth within a node
    fabric_gbps: float = 40.0  # GB/s per GPU between nodes
    gpus_per_node: int = 8


@dataclass
class GroupTraffic:
    axis: str
    ranks: list[int]
    bytes_received: dict[str, int]  # per collective kind, one step
    link: str  # "nvlink" or "fabric"
    seconds: float
    overlapped: bool


def _traffic(op: str, received: int, n: int) -> float:
    """Bytes this rank sends for a collective whose output received `received` bytes."""
    if n <= 1:
        return 0.0
    return {"all_gather": received * (n - 1) / n, "reduce_scatter": received * (n - 1),
            "all_reduce": 2 * received * (n - 1) / n, "all_to_all": received * (n - 1) / n,
            "send": received, "recv": 0.0}.get(op, 0.0)  # a transfer counted once, at its sender


def group_traffic(axis: str, ranks: list[int], moved: dict[str, int], links: Links) -> GroupTraffic:
    nodes = {rank // links.gpus_per_node for rank in ranks}
    link = "nvlink" if len(nodes) == 1 else "fabric"
    bandwidth = (links.nvlink_gbps if link == "nvlink" else links.fabric_gbps) * 1e9
    seconds = sum(_traffic(op, count, len(ranks)) for op, count in moved.items()) / bandwidth
    return GroupTraffic(axis, ranks, moved, link, seconds, overlapped=axis in FSDP_AXES)


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int) -> float:
    """The idle share of a pipeline step (module docstring); 0 without a pipeline."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def estimated_step(compute_s: float, traffic: list[GroupTraffic], bubble: float) -> dict[str, Any]:
    """The step on a real cluster: compute, exposed transfers, FSDP transfers beyond the compute,
    and the pipeline bubble on top of all of it."""
    exposed = sum(t.seconds for t in traffic if not t.overlapped)
    hidden = sum(t.seconds for t in traffic if t.overlapped)
    busy = compute_s + exposed + max(0.0, hidden - compute_s)
    total = busy / (1 - bubble) if bubble < 1 else float("inf")
    return {"compute_s": compute_s, "exposed_comm_s": exposed, "overlapped_comm_s": hidden,
            "fsdp_beyond_compute_s": max(0.0, hidden - compute_s), "bubble_fraction": bubble, "step_s": total}
