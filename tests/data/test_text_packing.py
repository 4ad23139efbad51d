"""Raw text into packed rows, exact against a direct computation with the tokenizer: EOS after each
document, document boundaries and masks, long documents split at the packed length with overlap,
and a target at every non-pad position but each document's last."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample
from glmtune.data.packing import PAD_DOCUMENT_ID, next_token_targets
from glmtune.data.text_corpus import TextCorpusOptions, build_text_corpus, load_split
from glmtune.data.text_packing import pack_documents, split_document

TEXTS = ["Section 1. The Supplier shall deliver steel brackets.", "Reset <|user|> the router, then wait.",
         " ".join(f"Step {i}: check the filter and the status light." for i in range(40)), "Short."]


def _direct(tokenizer, text: str) -> list[int]:
    """One document as raw text should be: its tokens, one call per document, then the EOS."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]


@pytest.fixture
def corpus_documents(tmp_path: Path, tiny_tokenizer) -> list[TokenizedSample]:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    corpus = build_text_corpus([path], TextCorpusOptions(ratios=(1.0, 0.0, 0.0)), tokenizer_dir=None,
                               cache_dir=tmp_path / "cache")
    return load_split(corpus, "train", len(tiny_tokenizer), tmp_path / "cache")


def test_tokens_are_the_tokenizers_with_eos_and_no_special_tokens_read_from_text(corpus_documents, tiny_tokenizer):
    assert [d.input_ids for d in corpus_documents] == [_direct(tiny_tokenizer, t) for t in TEXTS]
    assert all(d.labels == d.input_ids for d in corpus_documents)  # every token a target, no loss mask
    user = tiny_tokenizer.convert_tokens_to_ids("<|user|>")
    assert user not in corpus_documents[1].input_ids  # the text "<|user|>" is characters, not a turn
    assert tiny_tokenizer.decode(corpus_documents[1].input_ids[:-1]) == TEXTS[1]


@pytest.mark.parametrize("overlap", [0, 5])
def test_packed_rows_exact(corpus_documents, tiny_tokenizer, overlap: int) -> None:
    size = 64
    long_ids = _direct(tiny_tokenizer, TEXTS[2])
    assert len(long_ids) > 3 * size
    rows, stats, chunks = pack_documents(corpus_documents, size, pad_token_id=tiny_tokenizer.pad_token_id,
                                         overlap=overlap)
    # the direct computation: chunk i of the long document starts at i * (size - overlap)
    starts = range(0, len(long_ids), size - overlap)
    expected_chunks = [long_ids[s:s + size] for s in starts if s == 0 or s + overlap < len(long_ids)]
    assert chunks.num_split == 1 and chunks.num_chunks == len(expected_chunks)
    assert all(len(c) == size for c in expected_chunks[:-1])
    # a last chunk of context alone (with overlap 0: the EOS alone) has no target: packing drops it
    packed_chunks = [c for i, c in enumerate(expected_chunks) if i == 0 or len(c) > max(overlap, 1)]
    expected = {tuple(_direct(tiny_tokenizer, t)): 1 for t in (TEXTS[0], TEXTS[1], TEXTS[3])}
    seen: Counter = Counter()
    for row in rows:
        assert {len(row[f]) for f in row} == {size}
        documents = sorted(set(row["document_ids"]) - {PAD_DOCUMENT_ID})
        assert documents == list(range(len(documents)))
        for doc in documents:
            at = [i for i, d in enumerate(row["document_ids"]) if d == doc]
            assert at == list(range(at[0], at[-1] + 1))  # contiguous
            ids = row["input_ids"][at[0]:at[-1] + 1]
            labels = row["labels"][at[0]:at[-1] + 1]
            assert row["position_ids"][at[0]:at[-1] + 1] == list(range(len(ids)))
            seen[tuple(ids)] += 1
            if ids in expected_chunks and expected_chunks.index(ids) > 0:  # a later chunk: overlap is context
                assert labels == [IGNORE_INDEX] * max(overlap, 1) + ids[max(overlap, 1):]
            else:  # a whole document or a first chunk: every token but the first (boundary rule)
                assert labels == [IGNORE_INDEX] + ids[1:]
        pad = [i for i, d in enumerate(row["document_ids"]) if d == PAD_DOCUMENT_ID]
        assert all(row["input_ids"][i] == tiny_tokenizer.pad_token_id and row["labels"][i] == IGNORE_INDEX
                   for i in pad)
        assert pad == list(range(size - len(pad), size))
    assert seen == Counter({**expected, **Counter(tuple(c) for c in packed_chunks)})
    assert stats.num_tokens == sum(len(c) for c in packed_chunks) + sum(len(k) for k in expected)


def test_every_token_of_a_document_is_a_target_once_with_overlap(corpus_documents, tiny_tokenizer) -> None:
    """With overlap >= 1 the targets over all rows are exactly the documents' tokens but their first:
    the loss covers every non-pad position except each document's last (its EOS predicts nothing)."""
    rows, _, _ = pack_documents(corpus_documents, 48, pad_token_id=tiny_tokenizer.pad_token_id, overlap=3)
    targets: Counter = Counter()
    for row in rows:
        shifted = next_token_targets(row["labels"])
        for t, target in enumerate(shifted):
            here, after = row["document_ids"][t], (row["document_ids"] + [PAD_DOCUMENT_ID])[t + 1]
            assert (target != IGNORE_INDEX) == (here != PAD_DOCUMENT_ID and here == after and
                                                 row["labels"][t + 1] != IGNORE_INDEX)
            if target != IGNORE_INDEX:
                targets[target] += 1
    assert targets == Counter(token for d in corpus_documents for token in d.input_ids[1:])
    non_pad = sum(sum(d != PAD_DOCUMENT_ID for d in row["document_ids"]) for row in rows)
    documents = sum(len(set(row["document_ids"]) - {PAD_DOCUMENT_ID}) for row in rows)
    # no target at a document's last position, nor where a later chunk's next label is overlap context
    assert sum(targets.values()) == non_pad - documents - (3 - 1) * (documents - len(corpus_documents))


def test_split_document_chunks_and_policies(tiny_tokenizer) -> None:
    ids = list(range(1, 24))
    chunks = split_document(ids, 10, 2)
    assert [c.input_ids for c in chunks] == [ids[0:10], ids[8:18], ids[16:23]]
    assert chunks[1].labels == [IGNORE_INDEX] * 2 + ids[10:18]
    long = [TokenizedSample(ids, ids), TokenizedSample([1, 2], [1, 2])]
    rows, _, stats = pack_documents(long, 10, pad_token_id=0, policy="truncate")
    assert stats.num_truncated == 1 and sorted(r["input_ids"][:10] for r in rows)[-1] == ids[:10]
    rows, _, stats = pack_documents(long, 10, pad_token_id=0, policy="drop")
    assert stats.num_dropped == 1 and [r["input_ids"][:2] for r in rows] == [[1, 2]]
