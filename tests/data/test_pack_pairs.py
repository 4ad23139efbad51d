"""pack_pairs: a pair never split, chosen at the even document id, drops counted in pairs."""

from __future__ import annotations

import random

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample
from glmtune.data.packing import (PACKED_FIELDS, PAD_DOCUMENT_ID, first_fit_decreasing, pack_pairs, pack_samples,
                                  pair_document_count)
from glmtune.data.preferences import check_preferences_or_raise, tokenize_pair
from glmtune.data.sources import Origin, Row
from glmtune.data.synthetic_preferences import generate_preference_rows

PAD = 0


def answer(pair: int, side: int, length: int, prompt: int = 2) -> TokenizedSample:
    """Tokens pair*1000 + side*500 + i (side 0 chosen, 1 rejected); `prompt` tokens without labels."""
    ids = [pair * 1000 + side * 500 + i for i in range(length)]
    return TokenizedSample(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def documents(row):
    """{document id: input ids} of a packed row, padding left out."""
    out = {}
    for token, document_id in zip(row["input_ids"], row["document_ids"]):
        if document_id != PAD_DOCUMENT_ID:
            out.setdefault(document_id, []).append(token)
    return out


def test_every_pair_is_kept_together_with_chosen_first():
    rng = random.Random(0)
    pairs = [(answer(p, 0, rng.randint(3, 20)), answer(p, 1, rng.randint(3, 20))) for p in range(1, 120)]
    rows, stats = pack_pairs(pairs, 48, pad_token_id=PAD)
    seen = []
    for row in rows:
        assert set(row) == set(PACKED_FIELDS) and all(len(row[field]) == 48 for field in PACKED_FIELDS)
        docs = documents(row)
        assert sorted(docs) == list(range(len(docs))) and len(docs) % 2 == 0
        assert pair_document_count(row["document_ids"]) == len(docs) // 2
        for i in range(len(docs) // 2):
            chosen, rejected = docs[2 * i], docs[2 * i + 1]
            index = chosen[0] // 1000
            assert (chosen, rejected) == (pairs[index - 1][0].input_ids, pairs[index - 1][1].input_ids)
            seen.append(index)
        for start, (position, document_id) in enumerate(zip(row["position_ids"], row["document_ids"])):
            if position == 0 and document_id != PAD_DOCUMENT_ID:
                assert row["labels"][start] == IGNORE_INDEX  # boundary rule on every document
    assert sorted(seen) == list(range(1, 120))
    assert (stats.num_samples, stats.num_packed_samples, stats.num_rows) == (119, 119, len(rows))
    assert stats.num_tokens == sum(len(c.input_ids) + len(r.input_ids) for c, r in pairs)


def test_rows_follow_first_fit_decreasing_over_pair_lengths():
    pairs = [(answer(1, 0, 3), answer(1, 1, 3)), (answer(2, 0, 5), answer(2, 1, 4)),
             (answer(3, 0, 2, prompt=1), answer(3, 1, 2, prompt=1))]
    rows, _ = pack_pairs(pairs, 10, pad_token_id=PAD)
    assert first_fit_decreasing([6, 9, 4], 10) == [[1], [0, 2]]
    first, second = rows
    assert first["document_ids"] == [0] * 5 + [1] * 4 + [PAD_DOCUMENT_ID]
    assert first["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert first["labels"] == [IGNORE_INDEX, IGNORE_INDEX, 2002, 2003, 2004, IGNORE_INDEX, IGNORE_INDEX, 2502, 2503,
                               IGNORE_INDEX]
    assert second["document_ids"] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert second["input_ids"] == [1000, 1001, 1002, 1500, 1501, 1502, 3000, 3001, 3500, 3501]
    assert pair_document_count(second["document_ids"]) == 2 and pair_document_count([PAD_DOCUMENT_ID] * 3) == 0


def test_too_long_and_target_less_pairs_are_dropped_and_counted():
    fits_alone = (answer(1, 0, 6), answer(1, 1, 6))  # each answer fits a row of 10, the pair does not
    no_target = (answer(2, 0, 4), TokenizedSample([2500, 2501], [IGNORE_INDEX, IGNORE_INDEX]))
    first_only = (answer(3, 0, 4), TokenizedSample([3500, 3501], [3500, IGNORE_INDEX]))  # lost to the boundary rule
    kept = (answer(4, 0, 4), answer(4, 1, 4))
    rows, stats = pack_pairs([fits_alone, no_target, first_only, kept], 10, pad_token_id=PAD)
    assert (stats.num_dropped_too_long, stats.num_dropped_no_targets, stats.num_packed_samples) == (1, 2, 1)
    assert (stats.num_samples, stats.num_truncated, stats.longest_sample) == (4, 0, 12)
    assert len(rows) == 1 and documents(rows[0]) == {0: kept[0].input_ids, 1: kept[1].input_ids}
    with pytest.raises(ValueError, match="packed_sequence_size must be >= 2"):
        pack_pairs([kept], 1, pad_token_id=PAD)


def test_pack_samples_is_unchanged_by_the_pair_path():
    samples = [answer(d, 0, n, prompt=1) for d, n in enumerate([7, 3, 9, 2, 5], start=1)]
    rows, stats = pack_samples(samples, 12, pad_token_id=PAD)
    # FFD: 9 opens row 0, 7 row 1, 5 joins 7, 3 joins 9, 2 opens row 2.
    assert [documents(row) for row in rows] == [{0: samples[2].input_ids, 1: samples[1].input_ids},
                                                 {0: samples[0].input_ids, 1: samples[4].input_ids},
                                                 {0: samples[3].input_ids}]
    assert (stats.num_samples, stats.num_packed_samples, stats.num_rows, stats.num_padding) == (5, 5, 3, 10)


def test_tokenized_synthetic_pairs_pack_with_their_labels(tiny_tokenizer):
    rows = check_preferences_or_raise(Row(data, Origin("synth", i)) for i, data in
                                      enumerate(generate_preference_rows(24, seed=2)))
    pairs = [tokenize_pair(row.data, tiny_tokenizer) for row in rows]
    packed, stats = pack_pairs(pairs, 1024, pad_token_id=tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    assert stats.num_packed_samples == 24 and stats.num_rows == len(packed)
    by_ids = {tuple(chosen.input_ids + rejected.input_ids): (chosen, rejected) for chosen, rejected in pairs}
    found = 0
    for row in packed:
        for i in range(pair_document_count(row["document_ids"])):
            span = [k for k, d in enumerate(row["document_ids"]) if d in (2 * i, 2 * i + 1)]
            chosen, rejected = by_ids[tuple(row["input_ids"][k] for k in span)]
            assert [row["labels"][k] for k in span] == chosen.labels + rejected.labels  # first labels already -100
            found += 1
    assert found == 24
