"""Ranks that run one sharded model outside training: work split over them, collectives kept in step.

A model sharded with FSDP2 (and experts split over ep ranks) is one model across the ranks:
every forward gathers weights from, and sends tokens to, the other ranks, so every rank must
run the same number of forwards in the same order, whatever its own share of the work. Under
torchrun the ranks of `glmtune eval --nproc-per-node N` each take a slice of the prompts;
`Lockstep` is what they agree through:

  * `mine(n)`: this rank's items of n (item i belongs to rank i mod world), one slot per round
    of `world` items, None where this rank has nothing in that round (it then runs an idle
    forward: its share of the others' collectives);
  * `share(items)`: every rank's {index: result} merged, on every rank (the results of a round
    are needed everywhere: the next round's batches are formed from all requests);
  * `agree_max(n)`, `all_done(done)`: a count every rank loops to, and a stop every rank
    takes together (decode steps until the last rank's last row finished);
  * `gathered(module)`: a context in which an FSDP2 unit's own weights are whole, for code
    that calls a unit's submodules directly (cached decoding) so its forward hooks do not run.

In one process (`ONE_PROCESS`) every call is the identity, and nothing is communicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


class Lockstep:
    """The ranks of the default process group (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device  # where the agreement tensors live (nccl: the rank's GPU)
        self.idle = False  # an idle rank's rows count as done (`idling`)

    def mine(self, n: int) -> Iterator[int | None]:
        for start in range(0, n, self.world):
            index = start + self.rank
            yield index if index < n else None

    def share(self, items: dict[int, Any]) -> dict[int, Any]:
        gathered: list[dict[int, Any] | None] = [None] * self.world
        dist.all_gather_object(gathered, items)
        return {index: item for part in gathered for index, item in part.items()}

    def agree_max(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def all_done(self, done: bool) -> bool:
        return self.agree_max(0 if done or self.idle else 1) == 0

    @contextlib.contextmanager
    def idling(self) -> Iterator[None]:
        """A forward this rank takes only for the others' collectives: its own rows are done at once."""
        self.idle = True
        try:
            yield
        finally:
            self.idle = False

    @staticmethod
    @contextlib.contextmanager
    def gathered(module: torch.nn.Module) -> Iterator[None]:
        if not isinstance(module, FSDPModule):
            yield
            return
        module.unshard()
        try:
            yield
        finally:
            module.reshard()


class OneProcess:
    """The lockstep of one process: all items are this rank's, nothing to agree on or gather."""

    rank, world, idle = 0, 1, False

    @staticmethod
    def mine(n: int) -> Iterator[int | None]:
        return iter(range(n))

    @staticmethod
    def share(items: dict[int, Any]) -> dict[int, Any]:
        return items

    @staticmethod
    def agree_max(value: int) -> int:
        return value

    @staticmethod
    def all_done(done: bool) -> bool:
        return done

    @staticmethod
    def gathered(module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


ONE_PROCESS = OneProcess()
