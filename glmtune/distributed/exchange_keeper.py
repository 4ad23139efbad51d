"""What a checkpointed layer's recomputation takes from its forward instead of exchanging again.

Under activation checkpointing a layer's forward runs twice: in the forward pass, and again in
the backward pass to rebuild what its backward needs. An expert-parallel layer exchanges its
rows over the expert all-to-all each time (GLM-5 at 4K: 4096 tokens x 8 experts x 6144 x 2 B =
403 MB per exchange and micro-batch), so the recomputation adds a third to the layer's traffic.
A `Keeper`, opened around each run of one checkpointed call (`keeping`), keeps what the chosen
exchanges received in the forward and hands it back, in the same order, when the recomputation
asks for the same exchanges. The recomputation is the same computation on the same inputs, so
what it would receive again is what was kept: the gradients are unchanged (tested bit for bit on
gloo), and nothing is sent. The cost is memory: the kept rows live from the forward until the
layer's backward (`glmtune plan` counts them, `docs/distributed.md`).

What can be kept (`parallel.ep_keep_exchanges`):
  * "counts": the dispatch's per-expert counts and their host copy alone (a few bytes per layer): the
    recomputation exchanges its rows again but skips the count exchange and the host sync that waits for
    it. That sync drains the compute stream (everything queued before it, including waits for rows still
    in flight), so a recomputation without it lets more of the backward's work queue behind transfers;
  * "combine": the combine's received rows (the experts' outputs, back on the rank that routed
    them: T*K rows of D per MoE layer and micro-batch in flight); the dispatch is exchanged again;
  * "dispatch": the dispatch's per-expert counts, their host copy, and the rows received for this
    rank's experts (as many at balanced routing), so the recomputation also skips the count
    exchange and its host sync; the combine is exchanged again;
  * "both": both, so the recomputation exchanges nothing.

The dispatcher asks `current()` for the keeper of the call it runs in: None outside a
checkpointed call, or where nothing is kept (the forward of a call that will not be recomputed,
without gradients, keeps nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

KEEP_CHOICES = ("none", "counts", "combine", "dispatch", "both")
# What each choice keeps, by the dispatcher's names for its exchanges.
KEPT_EXCHANGES = {"none": frozenset(), "counts": frozenset({"dispatch_counts"}), "combine": frozenset({"combine"}),
                  "dispatch": frozenset({"dispatch", "dispatch_counts"}),
                  "both": frozenset({"combine", "dispatch", "dispatch_counts"})}
ROW_EXCHANGES = frozenset({"dispatch", "combine"})  # the exchanges whose kept rows cost memory


def kept_row_exchanges(choice: str) -> int:
    """How many of a MoE layer's row exchanges `choice` keeps per micro-batch (the plan's memory)."""
    return len(KEPT_EXCHANGES[choice] & ROW_EXCHANGES)


@dataclass
class Keeper:
    """One checkpointed call's kept exchanges: recorded by its first run, replayed by the next."""

    exchanges: frozenset[str]  # which exchanges are kept ("dispatch", "combine")
    runs: int = 0  # the call's runs so far: 1 = the forward, 2+ = recomputations
    items: dict[str, list[Any]] = field(default_factory=dict)  # exchange -> what it received, in order
    cursors: dict[str, int] = field(default_factory=dict)  # exchange -> the next item a replay hands back

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def keeps(self, exchange: str) -> bool:
        return exchange in self.exchanges

    def keep(self, exchange: str, item: Any) -> None:
        assert not self.replaying and self.keeps(exchange), exchange
        self.items.setdefault(exchange, []).append(item)

    def take(self, exchange: str) -> Any:
        """The next item `exchange` received in the forward (a recomputation asks in the same order)."""
        assert self.replaying and self.keeps(exchange), exchange
        index = self.cursors.get(exchange, 0)
        kept = self.items.get(exchange, [])
        assert index < len(kept), f"the recomputation asked for {exchange} #{index + 1}; the forward kept {len(kept)}"
        self.cursors[exchange] = index + 1
        return kept[index]


_CURRENT: ContextVar[Keeper | None] = ContextVar("glmtune_exchange_keeper", default=None)


def current() -> Keeper | None:
    """The keeper of the checkpointed call running now, when it keeps anything."""
    return _CURRENT.get()


@contextlib.contextmanager
def keeping(keeper: Keeper, records: bool) -> Iterator[None]:
    """One run of the keeper's call: its first (recording, when `records`: the call runs with
    gradients, so it will be recomputed) or a recomputation (replaying what the first recorded)."""
    keeper.runs += 1
    if keeper.replaying:
        keeper.cursors.clear()
        active = keeper if keeper.items else None  # a forward that recorded nothing has nothing to replay
    else:
        active = keeper if records else None
    token = _CURRENT.set(active)
    try:
        yield
    finally:
        _CURRENT.reset(token)
