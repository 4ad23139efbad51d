"""The retrieval arm's prompts: the top-k passages of the documents for each prompt, shown in its
system turn with an instruction to cite them.

The query is the prompt's last user turn; the passages are the `k` chunks BM25 ranks first
(`retrieval.py`; a chunk sharing no word with the query is never shown, so a prompt may get fewer,
or none: then it is the base's prompt), or with `--retriever embeddings:DIR` the k a local embedding
model ranks first (`embeddings.py`). They are appended to the prompt's system turn (one is
added when it has none) as

    <CITE_INSTRUCTION>

    [1] (catalog/payflow.md:3-9) text of the chunk ...
    [2] (...) ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmtune.decide.documents import Chunk, Corpus
from glmtune.decide.retrieval import Bm25Index

DEFAULT_PASSAGES, MAX_PASSAGES = 3, 32
CITE_INSTRUCTION = ("Passages from the documents follow. Answer from them, and cite each passage you use by its "
                    "number in brackets, as [1]. When the answer's required format has no room for citations (only "
                    "a JSON object, say), keep to the format.")


@dataclass(frozen=True)
class Shown:
    number: int  # as cited: [1], [2], ...
    chunk: Chunk
    score: float

    def to_json(self) -> dict:
        return {"number": self.number, "where": self.chunk.where, "score": round(self.score, 4),
                "text": self.chunk.text}


class Passages:
    """The documents' index and how many passages a prompt gets."""

    def __init__(self, corpus: Corpus, k: int, index=None, retriever: str = "bm25") -> None:
        """`index`: a built index of the chunks' texts with `search(query, k)` (an `EmbeddingIndex`,
        named `retriever` in the report); None: BM25's."""
        self.corpus, self.k, self.retriever = corpus, k, retriever
        self.index = index if index is not None else Bm25Index([chunk.text for chunk in corpus.chunks])

    def for_question(self, question: str) -> list[Shown]:
        return [Shown(n, self.corpus.chunks[hit.index], hit.score)
                for n, hit in enumerate(self.index.search(question, self.k), start=1)]

    def describe(self) -> str:
        c = self.corpus
        return (f"the top {self.k} of {len(c.chunks):,} chunks ({len(c.files)} files, {c.bytes:,} bytes; chunks of at "
                f"most {c.chunk_words} words, long paragraphs windowed with {c.overlap} words of overlap) by "
                f"{'BM25 (bm25s)' if self.retriever == 'bm25' else 'cosine of mean-pooled ' + self.retriever} "
                "against the prompt's last user turn, in its system turn with an instruction to cite them")


def with_passages(prompt: list[dict[str, Any]], shown: list[Shown]) -> list[dict[str, Any]]:
    """`prompt` with the passages (and the instruction) at the end of its system turn."""
    if not shown:
        return prompt
    block = CITE_INSTRUCTION + "\n\n" + "\n\n".join(f"[{s.number}] ({s.chunk.where}) {s.chunk.text}" for s in shown)
    if prompt and prompt[0]["role"] == "system":
        return [{**prompt[0], "content": prompt[0]["content"] + "\n\n" + block}] + prompt[1:]
    return [{"role": "system", "content": block}] + prompt
