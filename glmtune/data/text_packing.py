"""Raw-text documents into packed rows: long documents split at the row's length, then packing.py.

A document's tokens (its text's, then EOS) are all targets: labels equal the tokens, no template
and no loss mask. Packing is the chat path's own (`packing.pack_samples`: first-fit decreasing,
position ids restarting and a document id per document, so attention never crosses documents,
and the boundary rule: a document's first token is not a target, since nothing in its document
precedes it). So every non-pad position but a document's last (its EOS) predicts the next token.

A document longer than the packed row (`long_documents`):
  * `split` (default): chunks of exactly `size` tokens, each a document of its own (its own
    positions and attention); with `overlap` k, chunk i+1 starts k tokens before chunk i ends and
    those k tokens are context, not targets (labels -100), so every token of the document is a
    target exactly once (but the first of each chunk when k is 0, where the boundary rule takes
    it: k >= 1 loses none but the document's first). The last chunk holds the rest (shorter).
  * `truncate`: its first `size` tokens (the EOS is cut off with the rest);
  * `drop`: skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample
from glmtune.data.packing import PackingStats, pack_samples

LONG_DOCUMENT_POLICIES: tuple[str, ...] = ("split", "truncate", "drop")


@dataclass
class ChunkStats:
    num_documents: int = 0
    num_split: int = 0  # documents longer than a row, split
    num_chunks: int = 0  # the chunks those made
    num_truncated: int = 0
    num_dropped: int = 0
    num_overlap_tokens: int = 0  # context tokens repeated in later chunks (not targets)


def split_document(input_ids: Sequence[int], size: int, overlap: int) -> list[TokenizedSample]:
    """Chunks of `size` tokens (the last shorter), chunk i+1 starting `overlap` tokens before the end
    of chunk i; the repeated tokens' labels are -100 (module docstring)."""
    assert 0 <= overlap < size
    step = size - overlap
    chunks, start = [], 0
    while True:
        ids = list(input_ids[start:start + size])
        labels = list(ids) if start == 0 else [IGNORE_INDEX] * overlap + ids[overlap:]
        chunks.append(TokenizedSample(ids, labels))
        if start + size >= len(input_ids):
            return chunks
        start += step


def document_chunks(documents: Sequence[TokenizedSample], size: int, policy: str, overlap: int
                    ) -> tuple[list[TokenizedSample], ChunkStats]:
    """The long-document policy applied to every document (module docstring)."""
    if policy not in LONG_DOCUMENT_POLICIES:
        raise ValueError(f"long_documents must be one of {LONG_DOCUMENT_POLICIES}, got {policy!r}")
    stats = ChunkStats(num_documents=len(documents))
    out: list[TokenizedSample] = []
    for document in documents:
        ids = document.input_ids
        if len(ids) <= size:
            out.append(TokenizedSample(list(ids), list(document.labels)))
        elif policy == "split":
            chunks = split_document(ids, size, overlap)
            stats.num_split += 1
            stats.num_chunks += len(chunks)
            stats.num_overlap_tokens += overlap * (len(chunks) - 1)
            out += chunks
        elif policy == "truncate":
            stats.num_truncated += 1
            out.append(TokenizedSample(list(ids[:size]), list(document.labels[:size])))
        else:
            stats.num_dropped += 1
    return out, stats


def pack_documents(documents: Sequence[TokenizedSample], size: int, *, pad_token_id: int, policy: str = "split",
                   overlap: int = 0) -> tuple[list[dict[str, list[int]]], PackingStats, ChunkStats]:
    """Packed rows of `documents` (packing.py's format), with the long-document policy first."""
    chunks, chunk_stats = document_chunks(documents, size, policy, overlap)
    rows, stats = pack_samples(chunks, size, pad_token_id=pad_token_id, long_samples="truncate")
    assert stats.num_truncated == 0, "chunks fit a row"
    return rows, stats, chunk_stats


def chunk_notes(stats: ChunkStats, split: str, size: int, policy: str, overlap: int) -> list[str]:
    """One console line per thing the long-document policy did."""
    notes = []
    if stats.num_split:
        notes.append(f"split {stats.num_split:,} of {stats.num_documents:,} {split} documents longer than "
                     f"data.packed_sequence_size {size} into {stats.num_chunks:,} chunks (data.long_documents: "
                     f"{policy}, overlap {overlap})")
    if stats.num_truncated:
        notes.append(f"truncated {stats.num_truncated:,} of {stats.num_documents:,} {split} documents to their "
                     f"first {size} tokens (data.long_documents: truncate)")
    if stats.num_dropped:
        notes.append(f"dropped {stats.num_dropped:,} of {stats.num_documents:,} {split} documents longer than "
                     f"{size} tokens (data.long_documents: drop)")
    return notes
