"""Pack tokenized conversations into fixed-length rows (first-fit decreasing).

Output: one dict per packed row, every field a list of exactly
`packed_sequence_size` ints:
  * `input_ids`    - tokens of the documents, then padding (`pad_token_id`);
  * `labels`       - UNSHIFTED, aligned with input_ids (HF convention: the loss
                     compares logits[t] with labels[t + 1]); -100 = no loss;
  * `position_ids` - 0, 1, 2, ... restarting at every document;
  * `document_ids` - 0, 1, 2, ... per document within the row; padding is -1.

Boundary rule. With unshifted labels, the last position of document k is scored
against labels[first position of document k+1]. That target must not exist, so
the packer sets the label of every document's FIRST token to -100 (nothing inside
a document predicts its first token, so no real target is lost). A plain causal
shift over the packed row is then correct: no target crosses a document boundary,
and the last document's last position is scored against padding, which is also
-100. Attention must still be restricted to the same `document_ids` (block-causal).

Padding forms one trailing pseudo-document (document id -1, positions 0, 1, ...,
label -100) so position-based varlen detection sees it as a separate sequence.

Long samples (more than packed_sequence_size tokens): `truncate` keeps the first
packed_sequence_size tokens, `drop` discards the sample. Samples left without any
target (all labels -100 after the boundary rule) are dropped either way, since
they would only cost compute. Counts are returned in `PackingStats`.

First-fit decreasing: samples sorted by length (longest first, ties by input
order), each placed in the first row with room, found in O(log n) with a max
segment tree over the rows' free space. Deterministic for a given input order.

Packed preference pairs (`pack_pairs`), same row format. Within a row, documents
2i and 2i+1 are the chosen and the rejected answer of the row's pair i (chosen
first, at the even document id), each with its prompt: a pair is one unit of
first-fit decreasing over its total length, so it is never split across rows, and
the boundary rule applies to each of its two documents. Truncation is not offered
(a truncated answer is not the one that was preferred): a pair longer than a row is
dropped, and so is a pair whose chosen or rejected has no target left. In the
`PackingStats` of `pack_pairs`, num_samples, num_packed_samples, num_dropped_* count
pairs and longest_sample is the longest pair's total length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample

PAD_DOCUMENT_ID = -1
LongSamplePolicy = Literal["truncate", "drop"]
LONG_SAMPLE_POLICIES: tuple[str, ...] = ("truncate", "drop")
PACKED_FIELDS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids")
Document = tuple[list[int], list[int]]  # (input_ids, labels) after the boundary rule


@dataclass
class PackingStats:
    num_samples: int = 0
    num_packed_samples: int = 0
    num_truncated: int = 0
    num_dropped_too_long: int = 0
    num_dropped_no_targets: int = 0
    num_rows: int = 0
    num_tokens: int = 0  # non-padding tokens in the packed rows
    num_padding: int = 0
    longest_sample: int = 0  # tokens of the longest input sample, before truncation

    @property
    def efficiency(self) -> float:
        """Fraction of packed positions holding real tokens."""
        total = self.num_tokens + self.num_padding
        return self.num_tokens / total if total else 0.0


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into `lengths`) with sum of lengths <= capacity each.

    Bins are in opening order, indices in placement order. The tree's leaves are the
    free space of bins 0..n-1; bins not opened yet have full capacity, so the leftmost
    bin with room is either an open bin or the next one to open.
    """
    assert all(0 < length <= capacity for length in lengths)
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    free = [0] * (2 * size)
    free[size:size + len(lengths)] = [capacity] * len(lengths)
    for node in range(size - 1, 0, -1):
        free[node] = max(free[2 * node], free[2 * node + 1])
    bins: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        assert free[1] >= length  # n bins always suffice for n items
        node = 1
        while node < size:  # descend to the leftmost leaf with free >= length
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        bin_index = node - size
        if bin_index == len(bins):
            bins.append([])
        bins[bin_index].append(index)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def _prepare(samples: Sequence[TokenizedSample], size: int, policy: str,
             stats: PackingStats) -> list[tuple[list[int], list[int]]]:
    """Apply the long-sample policy and the boundary rule; drop target-less samples."""
    kept = []
    for sample in samples:
        input_ids, labels = list(sample.input_ids), list(sample.labels)
        stats.longest_sample = max(stats.longest_sample, len(input_ids))
        if len(input_ids) > size:
            if policy == "drop":
                stats.num_dropped_too_long += 1
                continue
            input_ids, labels = input_ids[:size], labels[:size]
            stats.num_truncated += 1
        if labels:
            labels[0] = IGNORE_INDEX  # boundary rule (module docstring)
        if all(label == IGNORE_INDEX for label in labels):
            stats.num_dropped_no_targets += 1
            continue
        kept.append((input_ids, labels))
    return kept


def pack_samples(samples: Sequence[TokenizedSample], packed_sequence_size: int, *, pad_token_id: int,
                 long_samples: LongSamplePolicy = "truncate") -> tuple[list[dict[str, list[int]]], PackingStats]:
    """Pack samples into rows of `packed_sequence_size` tokens (format in module docstring).

    Args:
        samples: tokenized conversations with unshifted labels.
        packed_sequence_size: length of every output row.
        pad_token_id: filler token id (GLM: <|endoftext|>); never a target.
        long_samples: "truncate" or "drop" for samples longer than a row.

    Returns:
        (rows, stats).
    """
    if packed_sequence_size < 2:
        raise ValueError(f"packed_sequence_size must be >= 2, got {packed_sequence_size}")
    if long_samples not in LONG_SAMPLE_POLICIES:
        raise ValueError(f"long_samples must be one of {LONG_SAMPLE_POLICIES}, got {long_samples!r}")
    stats = PackingStats(num_samples=len(samples))
    docs = _prepare(samples, packed_sequence_size, long_samples, stats)
    rows = [_build_row([docs[index] for index in bin_indices], packed_sequence_size, pad_token_id, stats)
            for bin_indices in first_fit_decreasing([len(ids) for ids, _ in docs], packed_sequence_size)]
    stats.num_rows = len(rows)
    stats.num_packed_samples = len(docs)
    return rows, stats


def _build_row(documents: list[Document], size: int, pad_token_id: int, stats: PackingStats) -> dict[str, list[int]]:
    """One packed row: the documents in order (document ids 0, 1, ...), then padding."""
    row: dict[str, list[int]] = {field: [] for field in PACKED_FIELDS}
    for document_id, (input_ids, labels) in enumerate(documents):
        row["input_ids"] += input_ids
        row["labels"] += labels
        row["position_ids"] += range(len(input_ids))
        row["document_ids"] += [document_id] * len(input_ids)
    num_padding = size - len(row["input_ids"])
    row["input_ids"] += [pad_token_id] * num_padding
    row["labels"] += [IGNORE_INDEX] * num_padding
    row["position_ids"] += range(num_padding)
    row["document_ids"] += [PAD_DOCUMENT_ID] * num_padding
    assert all(len(row[field]) == size for field in PACKED_FIELDS)
    stats.num_tokens += size - num_padding
    stats.num_padding += num_padding
    return row


def _prepare_pairs(pairs: Sequence[tuple[TokenizedSample, TokenizedSample]], size: int,
                   stats: PackingStats) -> list[tuple[Document, Document]]:
    """The boundary rule on both documents of each pair; drop too-long and target-less pairs."""
    kept = []
    for pair in pairs:
        documents = []
        for sample in pair:
            labels = list(sample.labels)
            if labels:
                labels[0] = IGNORE_INDEX  # boundary rule (module docstring)
            documents.append((list(sample.input_ids), labels))
        length = sum(len(input_ids) for input_ids, _ in documents)
        stats.longest_sample = max(stats.longest_sample, length)
        if length > size:
            stats.num_dropped_too_long += 1
        elif any(all(label == IGNORE_INDEX for label in labels) for _, labels in documents):
            stats.num_dropped_no_targets += 1
        else:
            kept.append((documents[0], documents[1]))
    return kept


def pack_pairs(pairs: Sequence[tuple[TokenizedSample, TokenizedSample]], packed_sequence_size: int, *,
               pad_token_id: int) -> tuple[list[dict[str, list[int]]], PackingStats]:
    """Pack (chosen, rejected) pairs into rows, a pair never split (module docstring).

    Args:
        pairs: (chosen, rejected) samples of one prompt each (preferences.tokenize_pair).
        packed_sequence_size: length of every output row.
        pad_token_id: filler token id; never a target.

    Returns:
        (rows, stats): rows as `pack_samples` makes them, document 2i the chosen and
        2i+1 the rejected answer of pair i of the row; stats count pairs.
    """
    if packed_sequence_size < 2:
        raise ValueError(f"packed_sequence_size must be >= 2, got {packed_sequence_size}")
    stats = PackingStats(num_samples=len(pairs))
    kept = _prepare_pairs(pairs, packed_sequence_size, stats)
    lengths = [len(chosen[0]) + len(rejected[0]) for chosen, rejected in kept]
    rows = [_build_row([document for index in bin_indices for document in kept[index]], packed_sequence_size,
                       pad_token_id, stats)
            for bin_indices in first_fit_decreasing(lengths, packed_sequence_size)]
    stats.num_rows = len(rows)
    stats.num_packed_samples = len(kept)
    return rows, stats


def pair_document_count(document_ids: Sequence[int]) -> int:
    """The number of pairs in a row packed by `pack_pairs` (its documents / 2)."""
    num_documents = max(document_ids, default=PAD_DOCUMENT_ID) + 1
    assert num_documents % 2 == 0, "a row of pairs holds an even number of documents"
    return num_documents // 2


def next_token_targets(labels: Sequence[int]) -> list[int]:
    """What a standard causal loss scores position t against: labels[t + 1], and -100
    at the last position. With packed rows no such target crosses a document boundary."""
    return list(labels[1:]) + [IGNORE_INDEX]


def second_next_targets(labels: Sequence[int], document_ids: Sequence[int]) -> list[int]:
    """What a multi-token-prediction layer at position t is scored against: labels[t + 2] (the
    token after next), -100 where t + 2 is past the row or in another document than t (MTP at
    t reads the embedding of token t + 1, so t + 1 and t + 2 both must belong to t's document)."""
    shifted = [label if here >= 0 and here == after else IGNORE_INDEX
               for label, here, after in zip(labels[2:], document_ids, document_ids[2:])]
    return shifted + [IGNORE_INDEX] * min(2, len(labels))

