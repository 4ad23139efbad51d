"""Packed rows -> micro-batches, in a seeded order that a checkpoint can resume exactly.

The order of rows in epoch e is a permutation drawn from `seed + e`, so the loader's
whole state is (epoch, cursor): saving those two integers and restoring them gives
the same batches as an uninterrupted run. Each rank takes every `world_size`-th
micro-batch of the global order.
"""

from __future__ import annotations

from typing import Any

import torch

from glmtune.data.packing import next_token_targets, second_next_targets
from glmtune.models.common.document_masks import longest_document, single_document_rows
from glmtune.models.common.microbatch import REFERENCE_LOGPS, TEACHER_IDS, TEACHER_LOGPS, TEACHER_MASK

# A preference run's reference log-probabilities (reference_logps.py): per supervised target in a
# packed row, [B, T] fp32 beside `targets` in a batch (`MicroBatch.ref_token_logps`, which
# preference.py reads).
REFERENCE_CACHE = REFERENCE_LOGPS


def collate(rows: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Stack packed rows; `targets[t]` is the token that should follow position t (-100: none).

    `mtp_targets[t]` is the token after that (`packing.second_next_targets`), for a multi-token-
    prediction layer. `longest_document`, `single_document`, `num_supervised` and `num_mtp_supervised`
    (ints, a bool) are computed here, on the host, so the
    model's forward needs no host sync to pick its attention path or its loss rows.
    """
    batch = {
        "input_ids": torch.tensor([r["input_ids"] for r in rows], dtype=torch.long),
        "targets": torch.tensor([next_token_targets(r["labels"]) for r in rows], dtype=torch.long),
        # the MTP layer's (token t + 2); read only when it trains
        "mtp_targets": torch.tensor([second_next_targets(r["labels"], r["document_ids"]) for r in rows],
                                    dtype=torch.long),
        "position_ids": torch.tensor([r["position_ids"] for r in rows], dtype=torch.long),
        "document_ids": torch.tensor([r["document_ids"] for r in rows], dtype=torch.long),
    }
    seq_len = batch["input_ids"].shape[1]
    batch["longest_document"] = longest_document(seq_len, document_ids_BS=batch["document_ids"])
    batch["single_document"] = single_document_rows(seq_len, document_ids_BS=batch["document_ids"])
    batch["num_supervised"] = int((batch["targets"] != -100).sum())
    batch["num_mtp_supervised"] = int((batch["mtp_targets"] != -100).sum())
    if REFERENCE_CACHE in rows[0]:  # a preference run's reference, per supervised target (reference_logps.py)
        ref = torch.zeros(batch["targets"].shape, dtype=torch.float32)
        ref[batch["targets"] != -100] = torch.cat([r[REFERENCE_CACHE] for r in rows])
        batch[REFERENCE_CACHE] = ref
    if TEACHER_IDS in rows[0]:  # a distillation run's teacher top-K at its positions (distill_data.py)
        batch.update(_teacher_top_k(rows, batch["targets"].shape))
    return batch


def _teacher_top_k(rows: list[dict[str, Any]], shape: torch.Size) -> dict[str, torch.Tensor]:
    """[B, T, K] ids and log-probabilities, [B, T] mask, of rows whose `teacher_positions` list the
    target positions their [n, K] `teacher_ids` / `teacher_logps` belong to (zeros elsewhere)."""
    k = rows[0][TEACHER_IDS].shape[1]
    ids = torch.zeros(*shape, k, dtype=torch.long)
    logps = torch.zeros(*shape, k, dtype=torch.float32)
    mask = torch.zeros(shape, dtype=torch.bool)
    for b, row in enumerate(rows):
        positions = torch.as_tensor(row["teacher_positions"], dtype=torch.long)
        ids[b, positions], logps[b, positions], mask[b, positions] = row[TEACHER_IDS], row[TEACHER_LOGPS], True
    return {TEACHER_IDS: ids, TEACHER_LOGPS: logps, TEACHER_MASK: mask}



def check_same_layout(state: dict[str, Any], layout: dict[str, Any], keep: str) -> None:
    """A checkpoint's data position means this run's rows only under the layout it was taken with:
    a key of `layout` the saved `state` holds with another value is a ValueError naming it."""
    for key, now in layout.items():
        if key in state and state[key] != now:
            raise ValueError(f"checkpoint data position was taken with {key}={state[key]}, this run has "
                             f"{key}={now}: resuming would not replay the same batches (keep {keep})")

class PackedRowLoader:
    def __init__(self, rows: list[dict[str, list[int]]], micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True) -> None:
        if len(rows) < micro_batch_size * world_size:
            raise ValueError(f"only {len(rows)} packed rows: fewer than micro_batch_size x data-parallel ranks "
                             f"({micro_batch_size} x {world_size}); add data or lower the batch size")
        self.rows = rows
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0  # index of the next global micro-batch within the epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // (self.micro_batch_size * self.world_size)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_batch(self) -> dict[str, Any]:
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
        order = self._order()
        group = self.micro_batch_size * self.world_size
        start = self.cursor * group + self.rank * self.micro_batch_size
        self.cursor += 1
        return collate([self.rows[i] for i in order[start : start + self.micro_batch_size]])

    def _layout(self) -> dict[str, Any]:
        # Everything that decides which rows a (epoch, cursor) position means.
        return {"num_rows": len(self.rows), "micro_batch_size": self.micro_batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_same_layout(state, self._layout(), "the data, train.seed, train.micro_batch_size and the "
                                                 "data-parallel size of the run")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
