"""Packed rows of several sources -> micro-batches whose target tokens follow the sources' weights.

The replay mix (`data.replay`) weighs its sources by training target tokens: the loss is a mean
over a step's targets, so a source's share of them is its share of the loss and of the gradient.
(A chat row's targets are its assistant tokens, a text row's nearly all its tokens: weighing rows
or all tokens would give a chat source far less of the gradient than its weight says.)

The global order of rows is built one row at a time: the next row comes from the source furthest
below its share, the source k maximizing `weight_k * drawn - drawn_k` (target tokens drawn so
far, over every rank; ties to the first source), and is that source's next row in its own seeded
permutation (seed, source, epoch), each source cycling through its rows at its own pace. So at
every point each source's share of the drawn targets is within one row's targets of its weight,
the order depends only on the rows, the weights and the seed, and every rank computes the same
order and takes its micro-batch of each group, as `PackedRowLoader` does.

The state is `PackedRowLoader`'s, (epoch, cursor) over nominal epochs of the concatenated rows,
plus the weights and the sources' row counts among the layout keys: a resume draws the same
number of micro-batches again (index arithmetic, no data) and continues the same order.
"""

from __future__ import annotations

from typing import Any

import torch

from glmtune.train.data_loader import check_same_layout, collate
from glmtune.train.mix_data import MixSources, target_tokens


class MixedRowLoader:
    def __init__(self, rows: list[dict[str, list[int]]], mix: MixSources, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        assert len(mix.row_sources) == len(rows) and len(mix.weights) == len(mix.names)
        self.members = [[i for i, s in enumerate(mix.row_sources) if s == k] for k in range(len(mix.names))]
        empty = [name for name, members in zip(mix.names, self.members) if not members]
        if empty:
            raise ValueError(f"the replay mix's {empty[0]} source has no packed training rows")
        if len(rows) < micro_batch_size * world_size:
            raise ValueError(f"only {len(rows)} packed rows: fewer than micro_batch_size x data-parallel ranks "
                             f"({micro_batch_size} x {world_size}); add data or lower the batch size")
        self.rows, self.names, self.weights = rows, mix.names, mix.weights
        self.micro_batch_size, self.seed, self.rank, self.world_size = micro_batch_size, seed, rank, world_size
        self.targets = [target_tokens(row) for row in rows]
        self.epoch = 0
        self.cursor = 0  # global micro-batches drawn in the (nominal) epoch, as PackedRowLoader counts them
        self._restart()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // (self.micro_batch_size * self.world_size)

    def _restart(self) -> None:
        """The stream at its start: no row drawn from any source."""
        k = len(self.names)
        self._source_epoch, self._source_next = [0] * k, [0] * k
        self._orders: dict[int, list[int]] = {}  # each source's permutation of its current epoch
        self.drawn = [0] * k  # target tokens drawn per source since the start (every rank's rows)
        self._window = [0] * k  # the same since the last `window_mix`

    def _source_order(self, k: int) -> list[int]:
        if k not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + 1_000_003 * k + self._source_epoch[k])
            members = self.members[k]
            self._orders[k] = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
        return self._orders[k]

    def _draw_row(self) -> int:
        """The next row of the global order (module docstring) and its source's count of it."""
        total = sum(self.drawn)
        k = max(range(len(self.names)), key=lambda s: (self.weights[s] * total - self.drawn[s], -s))
        order = self._source_order(k)
        row = order[self._source_next[k]]
        self._source_next[k] += 1
        if self._source_next[k] == len(order):  # the source's epoch is over: a new permutation next time
            self._source_epoch[k] += 1
            self._source_next[k] = 0
            del self._orders[k]
        self.drawn[k] += self.targets[row]
        self._window[k] += self.targets[row]
        return row

    def _draw_group(self) -> list[int]:
        """One global micro-batch group (every rank's rows), counted as PackedRowLoader counts it."""
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
        self.cursor += 1
        return [self._draw_row() for _ in range(self.micro_batch_size * self.world_size)]

    def next_batch(self) -> dict[str, Any]:
        group = self._draw_group()
        start = self.rank * self.micro_batch_size
        return collate([self.rows[i] for i in group[start : start + self.micro_batch_size]])

    def window_mix(self) -> dict[str, float]:
        """Each source's share of the target tokens drawn since the last call (`mix/<source>`), then a new window."""
        total = max(sum(self._window), 1)
        shares = {f"mix/{name}": n / total for name, n in zip(self.names, self._window)}
        self._window = [0] * len(self.names)
        return shares

    def _layout(self) -> dict[str, Any]:
        # Everything that decides which rows a (epoch, cursor) position means.
        return {"num_rows": len(self.rows), "micro_batch_size": self.micro_batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": True,
                "weights": list(self.weights), "source_rows": [len(m) for m in self.members]}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_layout(state, self._layout(), "the data, data.replay, train.seed, train.micro_batch_size and "
                                                 "the data-parallel size")
        position = state["epoch"] * self.batches_per_epoch + state["cursor"]
        self.epoch, self.cursor = 0, 0
        self._restart()
        for _ in range(position):  # the same draws again: index arithmetic only
            self._draw_group()
        if (self.epoch, self.cursor) != (state["epoch"], state["cursor"]):
            raise ValueError(f"checkpoint data position epoch {state['epoch']}, cursor {state['cursor']} is not one "
                             f"the loader reaches ({self.batches_per_epoch} micro-batches an epoch)")
        self._window = [0] * len(self.names)
