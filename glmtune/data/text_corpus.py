"""A raw-text corpus, read, checked, tokenized and split into the token cache in one streaming pass.

`build_text_corpus` reads documents (text_sources.py), tokenizes them in batches (no template,
no special tokens added, special-token text such as `<|user|>` tokenized as the characters it is,
the tokenizer's EOS appended to each document), applies the text contract (text_contract.py:
length, PII, exact and near duplicates, split by source) and streams each kept document's tokens
into its split's cache entry (token_cache.StreamingEntry). Memory holds one batch of documents,
the dedup digests and the offsets, never the corpus: RSS measured in docs/data.md.

The cache key (one entry per stored split) hashes the tokenizer files, the inputs' contents and
names, and every option that changes what is kept or how it is split; a hit reads neither the
tokenizer nor the data, only hashes them, and the contract's report comes back from the train
entry's sidecar (the PII report too, rewritten where the run wants it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from glmtune.data.chat_template import TokenizedSample
from glmtune.data.sources import file_sha256
from glmtune.data.text_contract import TextContract
from glmtune.data.text_sources import (TextDocument, TextReadOptions, expand_text_inputs, no_documents_message,
                                       read_documents)
from glmtune.data.token_cache import StreamingEntry, TokenizationCache, cache_key, tokenizer_sha256
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.io.json_file import read_json_file

_BATCH_DOCUMENTS = 64
_BATCH_BYTES = 4 << 20  # a batch of documents is tokenized in one call
_MAX_SIDECAR_BYTES = 256 << 20  # a train entry's sidecar holds the PII report's findings


@dataclass(frozen=True)
class TextCorpusOptions:
    read: TextReadOptions = TextReadOptions()
    min_tokens: int = 1
    max_tokens: int | None = None
    pii_action: str = "report"
    ratios: tuple[float, float, float] = (0.98, 0.02, 0.0)
    seed: int = 0


@dataclass
class TextCorpus:
    entries: dict[str, Path]  # stored split -> its cache entry
    keys: dict[str, str]
    report: dict[str, Any]  # text_contract.TextContract.report()
    pii_report: dict[str, Any]
    cache_hit: bool
    inputs: list[dict[str, Any]]  # every input file: path, source, bytes, sha256 (what the key hashed)


def tokenize_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's tokens then the EOS: no special tokens added, none read from the text."""
    encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [[*ids, tokenizer.eos_token_id] for ids in encoded]


def _batches(documents: Iterator[TextDocument]) -> Iterator[list[TextDocument]]:
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += len(document.text)
        if len(batch) >= _BATCH_DOCUMENTS or size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def input_files(paths: list[Path], file_format: str) -> list[dict[str, Any]]:
    """Every input file of `paths` (folders expanded): its path, source name, size and sha256."""
    return [{"path": str(path), "source": source, "bytes": path.stat().st_size, "sha256": file_sha256(path)}
            for path, source in expand_text_inputs(paths, file_format)]


def corpus_keys(inputs: list[dict[str, Any]], options: TextCorpusOptions, tokenizer_dir: Path,
                splits: tuple[str, ...]) -> dict[str, str]:
    """The cache key of each stored split (module docstring) from `input_files`' records."""
    hashed = [(f["source"], f["sha256"]) for f in inputs]
    data = hashlib.sha256(json.dumps({"inputs": hashed, "options": asdict(options)}, sort_keys=True).encode())
    tokenizer_hash = tokenizer_sha256(tokenizer_dir)
    return {split: cache_key(tokenizer_hash=tokenizer_hash, template="", data_hash=data.hexdigest(),
                             loss_on="every_token", enable_thinking=False, kind=f"text:{split}") for split in splits}


def build_text_corpus(paths: list[str | Path], options: TextCorpusOptions, *, tokenizer_dir: str | Path | None,
                      cache_dir: str | Path | None, splits: tuple[str, ...] = ("train", "validation")) -> TextCorpus:
    """Read, check, tokenize and split `paths` into one cache entry per split in `splits` (the other
    splits' documents are counted, not stored); a hit returns the stored entries (module docstring).
    No documents at all is a ValueError naming the inputs."""
    paths = [Path(p) for p in paths]
    directory = resolve_tokenizer_dir(tokenizer_dir)
    inputs = input_files(paths, options.read.file_format)
    keys = corpus_keys(inputs, options, directory, splits)
    cache = TokenizationCache(cache_dir)
    entries = {split: cache.path(key) for split, key in keys.items()}
    sidecar = entries[splits[0]].with_suffix(".json")
    if all(path.is_file() for path in entries.values()) and sidecar.is_file():
        meta = read_json_file(sidecar, "tokenization cache sidecar", max_bytes=_MAX_SIDECAR_BYTES)
        if not (isinstance(meta.get("contract"), dict) and isinstance(meta.get("pii_report"), dict)):
            raise ValueError(f"{sidecar}: not a text corpus sidecar glmtune writes (no contract and PII report); "
                             "delete it and its .npz to tokenize again")
        return TextCorpus(entries, keys, meta["contract"], meta["pii_report"], cache_hit=True, inputs=inputs)
    tokenizer = load_tokenizer(directory)
    contract = TextContract(options.min_tokens, options.max_tokens, options.pii_action, options.ratios, options.seed)
    writers = {split: StreamingEntry(cache, key) for split, key in keys.items()}
    try:
        for batch in _batches(read_documents(paths, options.read)):
            for document, ids in zip(batch, tokenize_texts(tokenizer, [d.text for d in batch])):
                split = contract.admit(document, len(ids) - 1)
                if split in writers:
                    writers[split].append(ids)
        report = contract.report()
        if not report["input"]["documents"]:
            raise ValueError(f"{no_documents_message(paths)}: nothing to tokenize")
        pii_report = contract.pii_report()
        meta = {"kind": "text", "data": [str(p) for p in paths], "tokenizer_dir": str(directory)}
        for split in reversed(splits):  # the first split's sidecar, which a hit reads, is written last
            extra = {"contract": report, "pii_report": pii_report} if split == splits[0] else {}
            writers.pop(split).commit({**meta, "split": split, **extra})
    finally:
        for writer in writers.values():
            writer.discard()
    return TextCorpus(entries, keys, report, pii_report, cache_hit=False, inputs=inputs)


def load_split(corpus: TextCorpus, split: str, vocab_size: int | None, cache_dir: str | Path | None
               ) -> list[TokenizedSample]:
    """The documents of one stored split, tokens with their EOS, labels equal to the tokens."""
    return TokenizationCache(cache_dir).get(corpus.keys[split], vocab_size) or []
