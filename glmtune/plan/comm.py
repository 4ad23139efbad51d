"""The time a measured rank's collectives would take on a real cluster: an estimate, said so.

`glmtune plan --measure` runs one rank with local stand-ins for its collectives
(`glmtune.distributed.loopback`), which count the bytes each group's collectives receive in a
step. This module turns those bytes into seconds with a stated model:

  * the link model (`glmtune.distributed.link_model`, which the link emulator of
    `--emulate-links` uses too): NVLink within a node, the fabric across nodes, ring traffic per
    collective, and a latency per ring step for each collective counted;
  * overlap: FSDP2's all-gathers and reduce-scatters (the dense and expert FSDP axes and HSDP's
    replica all-reduce) run on their own streams while layers compute, so they cost only what
    exceeds the compute; the expert all-to-all, context-parallel gathers and pipeline transfers
    sit between computations and are counted in full;
  * pipeline bubble: the measured rank's idle share of a step that runs every rank's actions in
    the schedule's own order (`glmtune.distributed.schedule_order.idle_fractions`: a forward
    costs 1, a backward 2, full checkpointing's recomputation 1 more; under checkpointing a split
    backward runs whole in its input half, as the pipeline runs it), added to the step. For 1F1B,
    GPipe and Interleaved1F1B that is (p - 1) / (v m + p - 1) for m micro-batches over p stages
    with v stages per rank; the zero-bubble schedules idle less with split backwards and more
    with whole ones (DualPipeV, pp 4, 16 microbatches: 5.9% split, 13.5% whole under full
    checkpointing, against 8.6% by that formula).

Latency is counted where the measurement counted the collectives (`calls`); at GLM-5's sizes
the bytes dominate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmtune.distributed.link_model import Links, collective_seconds
from glmtune.distributed.schedule_order import ActionCosts, idle_fractions

# Axes whose all-gathers, reduce-scatters and (HSDP) all-reduces FSDP2 issues, overlapped with compute.
FSDP_AXES = frozenset({"dp_shard", "dp_shard_cp", "efsdp", "dp_replicate"})
FSDP_OPS = frozenset({"all_gather", "reduce_scatter", "all_reduce"})


@dataclass
class GroupTraffic:
    """One kind of collective on one process group, over a step."""

    axes: str  # the mesh axes the group serves, "+"-joined
    op: str
    ranks: list[int]
    bytes_received: int
    link: str  # "nvlink" or "fabric"
    seconds: float
    overlapped: bool


def group_traffic(axes: str, ranks: list[int], moved: dict[str, int], links: Links,
                  calls: dict[str, int] | None = None) -> list[GroupTraffic]:
    """Per collective kind on a group: the seconds it would take (with each of `calls`' collectives'
    latency, where given) and whether FSDP2 hides it (an FSDP kind on a group that serves an FSDP
    axis and no context-parallel one)."""
    served = set(axes.split("+"))
    fsdp_group = bool(served & FSDP_AXES) and "cp" not in served
    return [GroupTraffic(axes, op, ranks, count, links.kind(ranks),
                         collective_seconds(op, count, ranks, links, (calls or {}).get(op, 0)),
                         overlapped=fsdp_group and op in FSDP_OPS) for op, count in sorted(moved.items())]


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int,
                    checkpointing: str) -> float:
    """Pp rank `pp_rank`'s idle share of a pipeline step (module docstring); 0 without a pipeline.
    `checkpointing`: the run's `parallel.activation_checkpointing`."""
    if pp <= 1:
        return 0.0
    if stages_per_rank == 1:  # 1F1B, GPipe: no per-rank order to walk, and none needed
        return (pp - 1) / (microbatches + pp - 1)
    costs = ActionCosts(recompute=1.0 if checkpointing == "full" else 0.0)
    return idle_fractions(schedule, pp, stages_per_rank, microbatches, checkpointing != "none", costs)[pp_rank]


def estimated_step(compute_s: float, traffic: list[GroupTraffic], bubble: float) -> dict[str, Any]:
    """The step on a real cluster: compute, exposed transfers, FSDP transfers beyond the compute,
    and the pipeline bubble on top of all of it."""
    exposed = sum(t.seconds for t in traffic if not t.overlapped)
    hidden = sum(t.seconds for t in traffic if t.overlapped)
    busy = compute_s + exposed + max(0.0, hidden - compute_s)
    return {"compute_s": compute_s, "exposed_comm_s": exposed, "overlapped_comm_s": hidden,
            "fsdp_beyond_compute_s": max(0.0, hidden - compute_s), "bubble_fraction": bubble,
            "step_s": with_bubble(busy, bubble)}


def with_bubble(busy_s: float, bubble: float) -> float:
    """A rank's busy seconds stretched by the pipeline bubble (the share of the step it idles)."""
    return busy_s / (1 - bubble) if bubble < 1 else float("inf")
