"""Retrieval by a local embedding model (`--retriever embeddings:DIR`), instead of BM25.

DIR is a transformers model directory on this machine (config.json, its weights, its tokenizer),
loaded by `AutoModel` and `AutoTokenizer` from the directory alone (`local_files_only`, no remote
code): nothing is downloaded. A text's embedding is the mean of the model's last hidden states over
its tokens (the attention mask's positions; a text longer than the model's longest input is
truncated), L2-normalized; a chunk's score for a query is the cosine of the two embeddings. The
chunks are embedded once, in batches of `BATCH`, on the CPU in float32; `search(query, k)` gives
the k best chunks, the higher score first, a tie in corpus order. Unlike BM25, every chunk has a
score, so a prompt always gets k passages (or every chunk, when there are fewer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from glmtune.decide.retrieval import Hit

PREFIX = "embeddings:"
BATCH = 32
_NO_LIMIT = 1_000_000  # a tokenizer's model_max_length when its files name none is far above this


def parse_retriever(value: str | None) -> Path | None:
    """`--retriever`: None for BM25 (`bm25`, the default), else the embedding model's directory
    (checked to be one: it holds config.json); ValueError in one sentence."""
    if value is None or value == "bm25":
        return None
    if not value.startswith(PREFIX) or not value[len(PREFIX):]:
        raise ValueError(f"--retriever {value}: expected bm25 or embeddings:DIR (a local embedding model's "
                         "directory)")
    directory = Path(value[len(PREFIX):])
    if not directory.is_dir():
        raise ValueError(f"--retriever {value}: {directory} is not a directory (a local transformers model's: "
                         "config.json, weights, tokenizer; nothing is downloaded)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"--retriever {value}: no config.json in {directory} (a local transformers model's "
                         "directory is expected; nothing is downloaded)")
    return directory


class EmbeddingIndex:
    """The texts embedded once by the model in `directory`; `search` as `Bm25Index.search`."""

    def __init__(self, directory: Path, texts: list[str]) -> None:
        assert texts, "an index needs at least one text"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            self.model = AutoModel.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:  # transformers' words for a directory it cannot load
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--retriever embeddings:{directory}: transformers cannot load it as an embedding "
                             f"model ({first})") from None
        self.model.eval()
        if self.tokenizer.pad_token is None:  # padded positions are masked out of the mean: any token will do
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"--retriever embeddings:{directory}: its tokenizer has no pad, end or unknown token "
                             "to pad a batch with")
        limits = [self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", None)]
        self.max_length = min(n for n in limits if n) if any(limits) else _NO_LIMIT
        self.size = len(texts)
        self.matrix = self.embed(texts)

    def embed(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), hidden]: each text's mean-pooled, L2-normalized embedding."""
        rows = []
        with torch.no_grad():
            for start in range(0, len(texts), BATCH):
                batch = self.tokenizer(texts[start:start + BATCH], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"]).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
                rows.append(torch.nn.functional.normalize(mean, dim=-1))
        return torch.cat(rows)

    def search(self, query: str, k: int) -> list[Hit]:
        scores = (self.matrix @ self.embed([query])[0]).numpy()
        order = np.argsort(-scores, kind="stable")[:k]
        return [Hit(int(i), float(scores[i])) for i in order]
