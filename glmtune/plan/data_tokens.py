"""What one epoch of the recipe's own data costs: its packed rows, real tokens and documents.

The recipe's data goes through the training pipeline itself (`prepare_data`: contract, PII
policy, dedup, split, tokenization with the recipe's tokenizer and chat template, packing
at `data.packed_sequence_size` with `data.too_long`), into a temporary directory; the
tokenization cache is shared with training, so a later `glmtune train` reuses it. The plan
then counts from the packed rows, not from a nominal length:
  rows per epoch (what the GPUs compute, padding included), real (non-padding) tokens,
  documents per row, the share of one-document rows, and every document's length (for the
  attention FLOPs, which depend on them).
A raw-text corpus (`data.kind: text`) takes the same path (`data/text_run_data.py`: read, text
contract, split by source, EOS after each document, long documents split at the row's length):
its rows are what remains after the contract, and the plan also reports the corpus' token count
before and after it (`corpus`: tokens read, removed by each rule, kept in each split), so
`--epochs` prices the tokens training will actually see.
A replay mix (`data.replay`): an epoch is one pass over the run's own (domain) rows with the
replay rows the mixed loader draws meanwhile — its weight's share of the target tokens, the
replay's rows taken in turn and again from the start when they run out, as the loader does
(`train/mix_loader.py`) — so the epoch's rows, tokens and document lengths are what training
computes (`mix`: the rows of each source in it).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from glmtune.config import JobConfig
from glmtune.models.catalog import is_preset
from glmtune.train.mix_data import MixSources, target_tokens
from glmtune.train.model_source import tokenizer_dir_for
from glmtune.train.run_data import prepare_data


@dataclass
class EpochTokens:
    rows: int
    seq: int
    real_tokens: int
    documents: int
    one_document_rows: int
    document_lengths: list[int] = field(repr=False, default_factory=list)
    corpus: dict | None = None  # a text corpus' contract counts (`corpus_counts`); None for chat rows
    mix: dict | None = None  # a replay mix's epoch: the weights and each source's rows in it (`_mixed_epoch`)

    @property
    def tokens(self) -> int:
        """Tokens the GPUs compute per epoch (padding included)."""
        return self.rows * self.seq

    def to_dict(self) -> dict:
        return {"rows": self.rows, "seq": self.seq, "tokens": self.tokens, "real_tokens": self.real_tokens,
                "documents": self.documents, "documents_per_row": round(self.documents / max(1, self.rows), 2),
                "one_document_rows": self.one_document_rows, **({"corpus": self.corpus} if self.corpus else {}),
                **({"mix": self.mix} if self.mix else {})}


def corpus_counts(manifest: dict) -> dict | None:
    """A text run's corpus before and after its contract (a document's own tokens, its EOS aside):
    read, removed per rule (only the rules that removed some), kept per split; None for chat data."""
    contract = manifest.get("contract") if manifest.get("kind") == "text" else None
    if contract is None:
        return None
    return {"documents": contract["input"]["documents"], "tokens": contract["input"]["tokens"],
            "removed_tokens": {rule: c["tokens"] for rule, c in contract["removed"].items() if c["documents"]},
            "kept_tokens": {split: c["tokens"] for split, c in contract["splits"].items()}}


def unreadable_data(cfg: JobConfig) -> str | None:
    """Why the recipe's training data cannot be read here (a placeholder path), else None."""
    missing = [p for p in cfg.data.train if not Path(p).exists() and "/" in p]
    if missing:
        return f"data.train {missing[0]} does not exist here (a placeholder?)"
    if not cfg.data.train and cfg.data.synthetic is None:
        return "data.train is empty and data.synthetic is not set"
    return None


def epoch_tokens(cfg: JobConfig, vocab_size: int, model_dir: Path | None = None) -> EpochTokens:
    """Pack the recipe's training data as `glmtune train` does and count it (module docstring)."""
    if model_dir is None and not cfg.data.tokenizer and not is_preset(cfg.model.name_or_path):
        # the tokenizer training will use is the checkpoint's: the bundled tiny one would count other tokens
        raise ValueError(f"glmtune plan counts data.train with the model's tokenizer, and model.name_or_path "
                         f"{cfg.model.name_or_path} is not here (a placeholder?): give --data.tokenizer DIR (the "
                         "checkpoint's tokenizer files) or --model.name_or_path CHECKPOINT, or plan without the "
                         "data (--no-data)")
    with tempfile.TemporaryDirectory(prefix="glmtune-plan-") as tmp:
        data = prepare_data(cfg, Path(tmp), tokenizer_dir_for(cfg, model_dir), vocab_size)
    rows, mix = (data.train_rows, None) if data.mix is None else _mixed_epoch(data.train_rows, data.mix)
    lengths, one_document = [], 0
    for row in rows:
        docs = _document_lengths(row["document_ids"])
        lengths += docs
        one_document += len(docs) == 1
    # real tokens: the packer's count; a mixed epoch's, counted in its rows (every document token is real)
    real = data.manifest["train_packing"]["num_tokens"] if mix is None else sum(lengths)
    return EpochTokens(rows=len(rows), seq=cfg.data.packed_sequence_size, real_tokens=real,
                       documents=len(lengths), one_document_rows=one_document, document_lengths=lengths,
                       corpus=corpus_counts(data.manifest), mix=mix)


def _mixed_epoch(train_rows: list, mix: MixSources) -> tuple[list, dict]:
    """One pass over the domain's rows and the replay rows drawn meanwhile (module docstring)."""
    domain = [row for row, source in zip(train_rows, mix.row_sources) if source == 0]
    replay = [row for row, source in zip(train_rows, mix.row_sources) if source == 1]
    domain_weight, replay_weight = mix.weights
    replay_targets = sum(map(target_tokens, domain)) * replay_weight / domain_weight
    per_row = sum(map(target_tokens, replay)) / len(replay)
    drawn = [replay[i % len(replay)] for i in range(round(replay_targets / per_row))]
    return domain + drawn, {
        "weights": dict(zip(mix.names, mix.weights)), "rows": {mix.names[0]: len(domain), mix.names[1]: len(drawn)},
        "targets": {name: sum(map(target_tokens, rows)) for name, rows in zip(mix.names, (domain, drawn))},
        "replay_rows_available": len(replay)}


def _document_lengths(document_ids: list[int]) -> list[int]:
    """Lengths of a row's documents in order (padding, id -1, is not a document)."""
    lengths: list[int] = []
    previous = None
    for doc in document_ids:
        if doc < 0:
            previous = None
            continue
        if doc != previous:
            lengths.append(0)
            previous = doc
        lengths[-1] += 1
    return lengths
