"""BM25 over texts (the documents' chunks, or the training examples' questions), by `bm25s`.

The scorer is the library's (`bm25s.BM25`, its defaults: Lucene's BM25, k1 1.5, b 0.75), and so is
the tokenizer (`bm25s.tokenize`: lower case, words of two or more letters or digits, its English
stop words removed, no stemming). What is added here is only the order: the texts by score, the
higher first, a tie kept in text order (the library's own top-k leaves ties in no stated order),
and a text that shares no word with the query (score 0) is never returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import bm25s
import numpy as np

STOPWORDS = "en"


@dataclass(frozen=True)
class Hit:
    index: int  # the text's position in the indexed list
    score: float


def tokenize(texts: list[str], ids: bool = True):
    """bm25s's tokenization of `texts` (ids and vocabulary, or the words with `ids=False`)."""
    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=ids, show_progress=False)


class Bm25Index:
    """The texts indexed once; `search(query, k)` gives the k best hits."""

    def __init__(self, texts: list[str]) -> None:
        assert texts, "an index needs at least one text"
        self.size = len(texts)
        self.retriever = bm25s.BM25()
        self.retriever.index(tokenize(texts), show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """The library's BM25 score of every text for `query` (zeros when no query word is indexed)."""
        ids = self.retriever.get_tokens_ids(tokenize([query], ids=False)[0])
        if not ids:
            return np.zeros(self.size, dtype=np.float32)
        return self.retriever.get_scores_from_ids(ids)

    def search(self, query: str, k: int) -> list[Hit]:
        scores = self.scores(query)
        order = np.argsort(-scores, kind="stable")[:k]
        return [Hit(int(i), float(scores[i])) for i in order if scores[i] > 0]
