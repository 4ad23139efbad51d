"""Which queries of every row this process computes under context parallelism (CP).

Every cp rank receives the same full rows (ids, positions, documents, targets) and
computes a subset of their queries, keeping each query's global index: positions,
causality and documents are those of the full row. Keys come from every rank: the
model all-gathers what it needs per layer (the MLA latent and rope key, the indexer
keys) through `SequenceShard.gather`, which a distributed wrapper injects
(`glmtune/distributed/context_parallel.py`); in one process (size 1) it is the identity.

Two ways to cut a row of T tokens over cp ranks:
  * "contiguous": rank r owns [r·L, (r+1)·L), L = T / cp (NVIDIA AutoModel's scheme).
    Causal work grows with the query index, so the last rank does ~2·cp−1 times the
    first rank's attention and indexer work.
  * "head_tail": the row cut in 2·cp chunks of C = T / (2·cp); rank r owns chunks r and
    2·cp−1−r, so every rank holds one early and one late chunk and the same number of
    causal (query, key) pairs (`causal_pairs`).

A rank's queries are a few contiguous *pieces* of the row, [start, start + length),
listed in row order; adjacent chunks merge (head_tail's last rank owns chunks cp−1 and cp:
one piece).
The local tokens are the pieces concatenated in that order.

Legend: B batch, T tokens of a row, S this rank's queries (T / cp), X any feature dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

BALANCES = ("head_tail", "contiguous")


def pieces_of(rank: int, size: int, balance: str, seq_len: int) -> list[tuple[int, int]]:
    """The (start, length) pieces of rank `rank` of `size` in a row of `seq_len` tokens."""
    if balance == "contiguous":
        if seq_len % size:
            raise ValueError(f"data.packed_sequence_size: rows of {seq_len} tokens do not split into "
                             f"parallel.cp={size} equal slices (parallel.cp_balance contiguous)")
        length = seq_len // size
        return [(rank * length, length)]
    if seq_len % (2 * size):
        raise ValueError(f"data.packed_sequence_size: rows of {seq_len} tokens do not split into "
                         f"2 x parallel.cp={2 * size} equal chunks (parallel.cp_balance head_tail)")
    chunk = seq_len // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    if head + chunk == tail:  # the last rank: its two chunks touch
        return [(head, 2 * chunk)]
    return [(head, chunk), (tail, chunk)]


def _gather_in_one_process(x_BSX: torch.Tensor) -> torch.Tensor:
    return x_BSX


@dataclass(frozen=True)
class SequenceShard:
    """This process's queries: rank `rank` of `size` cp ranks, cut by `balance`.

    Args:
        rank, size: this process's index among the cp ranks and their number.
        balance: "head_tail" or "contiguous" (module docstring).
        gather: local [B, S, X] -> full row [B, T, X] in global token order, differentiable
            (the gradient of each local token is the sum over ranks of its full-row
            gradients). The identity when `size` is 1; injected by
            `glmtune.distributed.context_parallel.apply_context_parallel` otherwise.
    """

    rank: int
    size: int
    balance: str = "head_tail"
    gather: Callable[[torch.Tensor], torch.Tensor] = field(default=_gather_in_one_process, compare=False)

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"parallel.cp_balance={self.balance!r}: choose from {', '.join(BALANCES)}")
        assert 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.size == 1 or self.gather is not _gather_in_one_process, "size > 1 needs a distributed gather"

    def pieces(self, seq_len: int) -> list[tuple[int, int]]:
        """(start, length) of each run of consecutive local queries, in row order."""
        return pieces_of(self.rank, self.size, self.balance, seq_len)

    def num_local(self, seq_len: int) -> int:
        return seq_len // self.size

    def key_end(self, seq_len: int) -> int:
        """One past the last local query: no local query may attend a later key."""
        start, length = self.pieces(seq_len)[-1]
        return start + length

    def query_index(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [S]: the global index in the row of each local query, in local order."""
        return torch.cat([torch.arange(start, start + length, device=device)
                          for start, length in self.pieces(seq_len)])

    def local(self, t_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a per-token tensor [B, T, ...] -> [B, S, ...] (dim 1 is the row).
        A [1, T] tensor (positions shared by the rows) stays [1, S]."""
        return take_pieces(t_BT, self.pieces(t_BT.shape[1]))


def take_pieces(t_BT: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """The tokens of `pieces` of a per-token tensor [B, T, ...], concatenated along dim 1."""
    parts = [t_BT[:, start:start + length] for start, length in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def causal_pairs(pieces: list[tuple[int, int]], window: int | None = None) -> int:
    """(query, key) pairs the pieces' queries attend in one causal document row: query i
    sees i + 1 keys, or min(i + 1, window) under a top-`window` selection."""
    total = 0
    for start, length in pieces:
        end = start + length
        if window is None:
            total += (end * (end + 1) - start * (start + 1)) // 2
        else:
            total += sum(min(i + 1, window) for i in range(start, end))
    return total
