"""BM25 retrieval (glmtune/decide/retrieval.py) is bm25s's: the same scores and the same ranking as
the library's own `retrieve` on the same corpus; ties keep text order, and a text sharing no word
with the query is never returned."""

from __future__ import annotations

import random

import bm25s
import numpy as np

from glmtune.decide.retrieval import Bm25Index

_VOCAB = [f"term{i}" for i in range(60)] + ["the", "of", "and", "payflow", "cloudsync", "refund", "outage"]


def _corpus(n: int = 200, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_VOCAB) for _ in range(rng.randrange(5, 40))) for _ in range(n)]


def test_ranking_and_scores_equal_the_librarys_own_retrieve():
    corpus = _corpus()
    index = Bm25Index(corpus)
    library = bm25s.BM25()
    library.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False)
    rng = random.Random(7)
    compared = 0
    for _ in range(60):
        query = " ".join(rng.choice(_VOCAB) for _ in range(rng.randrange(1, 6)))
        docs, scores = library.retrieve(bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False),
                                        k=11, show_progress=False)
        ours = index.search(query, 10)
        positive = [(int(d), float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]
        if len({s for _, s in positive}) < len(positive):
            continue  # tied scores (the 11th too): the library's top-k states no order among them (tested below)
        assert [(h.index, h.score) for h in ours] == positive[:10], query
        compared += 1
    assert compared >= 30


def test_ties_keep_text_order_and_unmatched_texts_are_never_returned():
    index = Bm25Index(["alpha beta", "gamma delta", "alpha beta", "beta alpha"])
    assert [h.index for h in index.search("alpha", 10)] == [0, 2, 3]
    assert index.search("epsilon", 10) == [] and index.search("the of", 10) == []  # stop words only
    assert len(index.search("alpha", 2)) == 2
    assert np.array_equal(index.scores("epsilon"), np.zeros(4, dtype=np.float32))
