"""Packing: row format, document boundaries, FFD determinism, long-sample policies."""

from __future__ import annotations

import random

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample
from glmtune.data.packing import PACKED_FIELDS, PAD_DOCUMENT_ID, first_fit_decreasing, next_token_targets, pack_samples

PAD = 0


def sample(doc: int, length: int, prompt: int = 1) -> TokenizedSample:
    """Tokens doc*1000 + i; the first `prompt` tokens are prompt, the rest targets."""
    ids = [doc * 1000 + i for i in range(length)]
    return TokenizedSample(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def naive_ffd(lengths, capacity):
    bins, free = [], []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if room >= lengths[index]:
                bins[b].append(index)
                free[b] -= lengths[index]
                break
        else:
            bins.append([index])
            free.append(capacity - lengths[index])
    return bins


def test_ffd_known_example_and_against_naive():
    assert first_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert first_fit_decreasing([], 10) == []
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 200))]
        assert first_fit_decreasing(lengths, 64) == naive_ffd(lengths, 64)


def test_row_format_positions_and_padding():
    rows, stats = pack_samples([sample(1, 5), sample(2, 3, prompt=2), sample(3, 6)], 10, pad_token_id=PAD)
    assert len(rows) == 2 and all(set(row) == set(PACKED_FIELDS) for row in rows)
    assert all(len(row[field]) == 10 for row in rows for field in PACKED_FIELDS)
    first, second = rows
    # FFD: 6 opens row 0, 5 opens row 1, 3 fits after 6.
    assert first["input_ids"] == [3000, 3001, 3002, 3003, 3004, 3005, 2000, 2001, 2002, PAD]
    assert first["position_ids"] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0]
    assert first["document_ids"] == [0, 0, 0, 0, 0, 0, 1, 1, 1, PAD_DOCUMENT_ID]
    assert first["labels"] == [IGNORE_INDEX, 3001, 3002, 3003, 3004, 3005, IGNORE_INDEX, IGNORE_INDEX, 2002,
                               IGNORE_INDEX]
    assert second["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # padding counts from 0 as its own block
    assert second["document_ids"] == [0] * 5 + [PAD_DOCUMENT_ID] * 5
    assert second["labels"][5:] == [IGNORE_INDEX] * 5 and second["input_ids"][5:] == [PAD] * 5
    assert (stats.num_rows, stats.num_tokens, stats.num_padding) == (2, 14, 6)
    assert stats.efficiency == pytest.approx(0.7)


def test_no_target_crosses_a_document_boundary():
    rng = random.Random(1)
    # Fully supervised documents (prompt=0) are the worst case: every first token is a label.
    samples = [sample(doc, rng.randint(4, 40), prompt=rng.choice([0, 1, 3])) for doc in range(1, 300)]
    rows, stats = pack_samples(samples, 64, pad_token_id=PAD)
    assert stats.num_packed_samples == 299
    for row in rows:
        targets = next_token_targets(row["labels"])
        docs = row["document_ids"]
        for t, target in enumerate(targets):
            if target != IGNORE_INDEX:
                assert docs[t] == docs[t + 1] != PAD_DOCUMENT_ID
                assert target == row["input_ids"][t + 1]
        for t in range(1, 64):
            if docs[t] != docs[t - 1]:
                assert row["labels"][t] == IGNORE_INDEX and row["position_ids"][t] == 0
    # Per document, the packed shifted targets are exactly the unpacked shifted ones minus the
    # (never scored) first label: nothing is lost, nothing leaks.
    by_first_token = {s.input_ids[0]: s for s in samples}
    for row in rows:
        starts = [t for t in range(64) if row["position_ids"][t] == 0 and row["document_ids"][t] != PAD_DOCUMENT_ID]
        for start in starts:
            original = by_first_token[row["input_ids"][start]]
            n = len(original.input_ids)
            assert next_token_targets(row["labels"][start:start + n]) == next_token_targets(original.labels)


def test_packing_is_deterministic():
    rng = random.Random(2)
    samples = [sample(doc, rng.randint(2, 30)) for doc in range(1, 100)]
    assert pack_samples(samples, 48, pad_token_id=PAD) == pack_samples(list(samples), 48, pad_token_id=PAD)


def test_long_sample_policies():
    samples = [sample(1, 12, prompt=2), sample(2, 4), sample(3, 30, prompt=25)]
    rows, stats = pack_samples(samples, 10, pad_token_id=PAD, long_samples="truncate")
    assert (stats.num_truncated, stats.num_dropped_too_long, stats.num_dropped_no_targets) == (2, 0, 1)
    assert rows[0]["input_ids"] == [1000 + i for i in range(10)]  # first 10 tokens kept
    assert stats.num_packed_samples == 2 and len(rows) == 2

    rows, stats = pack_samples(samples, 10, pad_token_id=PAD, long_samples="drop")
    assert (stats.num_truncated, stats.num_dropped_too_long, stats.num_dropped_no_targets) == (0, 2, 0)
    assert len(rows) == 1 and rows[0]["input_ids"][:4] == [2000, 2001, 2002, 2003]


def test_target_less_samples_are_dropped_and_bad_options_rejected():
    rows, stats = pack_samples([sample(1, 5, prompt=5), TokenizedSample([7, 8], [7, IGNORE_INDEX])], 8,
                               pad_token_id=PAD)
    assert rows == [] and stats.num_dropped_no_targets == 2
    with pytest.raises(ValueError, match="long_samples"):
        pack_samples([], 8, pad_token_id=PAD, long_samples="wrap")
    with pytest.raises(ValueError, match="packed_sequence_size"):
        pack_samples([], 1, pad_token_id=PAD)
