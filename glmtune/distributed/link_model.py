"""How long a collective takes on a cluster's links: the one model that both the link emulator
(`link_emulator.py`, which makes a measured rank wait that long) and `glmtune plan`'s transfer
estimate (`glmtune.plan.comm`) use.

A group whose ranks share a node talks over NVLink, one that spans nodes over the inter-node
fabric. Ranks fill nodes in order (global rank // GPUs per node), as torchrun and srun place
them. The defaults describe H100/H200 nodes: NVLink 4 through NVSwitch at an NCCL bus bandwidth
of 360 GB/s; one 400 Gb/s NIC per GPU, 40 GB/s.

A collective on n ranks, ring algorithms (NCCL's for these sizes), given the bytes its output
received on this rank:

  * bytes sent: an all-gather (n-1)/n of its output, a reduce-scatter (n-1) times its output
    (one shard), an all-reduce 2(n-1)/n of its tensor, an all-to-all (n-1)/n of what it
    receives, a send its bytes (a receive is counted at its sender);
  * messages in sequence: n-1 ring steps (all-gather, reduce-scatter, all-to-all's pairwise
    exchanges), 2(n-1) for an all-reduce, 1 for a send; each costs `latency_us` on top of the
    bytes' time.

seconds = bytes sent / bandwidth + messages x latency. A group of one moves nothing.

An all-to-all is not a ring: NCCL runs it as one send and one receive per peer, all at once, so
across nodes the bytes for peers on this rank's own node take NVLink while the rest take the
fabric, side by side. With a group of n ranks, g of them on each of its nodes, and the bytes
spread evenly over the peers (balanced routing), (g - 1)/n of what it receives comes over NVLink
and (n - g)/n over the fabric; it takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    nvlink_gbps: float = 360.0  # GB/s of NCCL bus bandwidth within a node
    fabric_gbps: float = 40.0  # GB/s per GPU between nodes
    gpus_per_node: int = 8
    latency_us: float = 5.0  # per message of a collective (module docstring), either link

    def kind(self, ranks: list[int]) -> str:
        """"nvlink" for ranks on one node, else "fabric"."""
        return "nvlink" if len({rank // self.gpus_per_node for rank in ranks}) == 1 else "fabric"

    def bandwidth(self, ranks: list[int]) -> float:
        """Bytes per second the group's collectives move."""
        return (self.nvlink_gbps if self.kind(ranks) == "nvlink" else self.fabric_gbps) * 1e9


def bytes_sent(op: str, received: int, n: int) -> float:
    """Bytes this rank sends for a collective whose output received `received` bytes."""
    if n <= 1:
        return 0.0
    return {"all_gather": received * (n - 1) / n, "reduce_scatter": received * (n - 1),
            "all_reduce": 2 * received * (n - 1) / n, "all_to_all": received * (n - 1) / n,
            "send": received, "recv": 0.0}.get(op, 0.0)


def messages(op: str, n: int) -> int:
    """Messages one collective sends in sequence (ring steps)."""
    if n <= 1:
        return 0
    return {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 2 * (n - 1), "all_to_all": n - 1,
            "send": 1}.get(op, 0)


def _all_to_all_transfer_seconds(received: int, ranks: list[int], links: Links) -> float:
    """An all-to-all's bytes over a group that spans nodes: NVLink to the peers on this rank's
    node and the fabric to the others at once (module docstring)."""
    n = len(ranks)
    per_node = n / len({rank // links.gpus_per_node for rank in ranks})  # g: ranks fill nodes in order
    nvlink = received * (per_node - 1) / n / (links.nvlink_gbps * 1e9)
    fabric = received * (n - per_node) / n / (links.fabric_gbps * 1e9)
    return max(nvlink, fabric)


def collective_seconds(op: str, received: int, ranks: list[int], links: Links, calls: int = 1) -> float:
    """The time `calls` collectives of kind `op` on the group `ranks`, whose outputs received
    `received` bytes in all, take on `links`."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    if op == "all_to_all" and links.kind(ranks) == "fabric":
        transfer = _all_to_all_transfer_seconds(received, ranks, links)
    else:
        transfer = bytes_sent(op, received, n) / links.bandwidth(ranks)
    return transfer + calls * messages(op, n) * links.latency_us * 1e-6
