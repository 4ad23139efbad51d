"""A run's raw-text data (`data.kind: text`): the recipe's `data` section to packed rows.

`glmtune train` (and `glmtune plan`, through the same `train/run_data.prepare_data`) come here for
a text recipe: the corpus is built into the token cache (text_corpus.py: read, contract, split
by source), the train and validation documents are read back and packed (text_packing.py).
Validation documents are `data.validation`'s files when given (all their documents; the contract's
length and PII rules and dedup within them), else the validation share of `data.split`; the
test share is counted in the report and never trained on. The manifest records the contract's
report: documents and tokens each rule removed, and what each split kept. RUN_DIR/data/text_inputs.json
lists each split's input files (path, source, size, sha256): the run's data files, which `glmtune
release` records, as a chat run's split rows are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.config import JobConfig
from glmtune.data.text_contract import removal_notes
from glmtune.data.text_corpus import TextCorpus, TextCorpusOptions, build_text_corpus, load_split
from glmtune.data.text_packing import chunk_notes, pack_documents
from glmtune.data.text_sources import TextReadOptions


INPUTS_FILE = "text_inputs.json"  # RUN_DIR/data/: each split's input files with their sha256


@dataclass
class TextRunData:
    train_rows: list[dict[str, list[int]]]
    val_rows: list[dict[str, list[int]]]
    manifest: dict[str, Any]
    notes: list[str]


def corpus_options(cfg: JobConfig, ratios: tuple[float, float, float]) -> TextCorpusOptions:
    """The text keys of `cfg.data` as the corpus builder takes them."""
    d = cfg.data
    read = TextReadOptions(text_field=d.text_field, separator=d.text_separator, source_field=d.source_field,
                           file_format=d.format)
    return TextCorpusOptions(read=read, min_tokens=d.min_document_tokens, max_tokens=d.max_document_tokens,
                             pii_action=d.pii, ratios=ratios, seed=cfg.train.seed)


def _built(cfg: JobConfig, paths: list[str], ratios: tuple[float, float, float], tokenizer_dir: Path | None,
           report_path: Path, what: str) -> TextCorpus:
    """The corpus of `paths`, its PII report written to `report_path`; data.pii: fail with findings, or
    nothing left in the split the run needs, is a ValueError."""
    corpus = build_text_corpus(paths, corpus_options(cfg, ratios), tokenizer_dir=tokenizer_dir,
                               cache_dir=cfg.data.cache_dir)
    report_path.write_text(json.dumps(corpus.pii_report, indent=2) + "\n")
    pii = corpus.pii_report
    if cfg.data.pii == "fail" and pii["num_findings"]:
        first = pii["findings"][0]
        raise ValueError(f"{first['file']}:{first['line']}: {first['field']}: {first['kind']} ({first['match']}) "
                         f"(and {pii['num_findings'] - 1} more findings; data.pii is 'fail'; report in {report_path})")
    needed = "train" if ratios[0] else "validation"
    if not corpus.report["splits"][needed]["documents"]:
        notes = "; ".join(removal_notes(corpus.report)) or "the split sent every source elsewhere"
        raise ValueError(f"{what}: no {needed} documents left ({corpus.report['input']['documents']:,} read; "
                         f"{notes}); sources stay whole in one split, so few sources split coarsely")
    return corpus


def _write_inputs(data_dir: Path, inputs: dict[str, list[dict[str, Any]]]) -> None:
    """data_dir/INPUTS_FILE, whole or not at all (every rank writes the same: each through its own temp file)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{INPUTS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(inputs, indent=1) + "\n")
    tmp.replace(data_dir / INPUTS_FILE)


def prepare_text_data(cfg: JobConfig, run_dir: Path, tokenizer_dir: Path | None, tokenizer: Any) -> TextRunData:
    """Build, read back and pack the run's text corpus (module docstring)."""
    d = cfg.data
    ratios = (1.0, 0.0, 0.0) if d.validation else (d.split.get("train", 0.0), d.split.get("validation", 0.0),
                                                    d.split.get("test", 0.0))
    corpus = _built(cfg, d.train, ratios, tokenizer_dir, run_dir / "pii_report.json", "data.train")
    parts = {"train": (corpus, "train")}
    if d.validation:
        val_corpus = _built(cfg, d.validation, (0.0, 1.0, 0.0), tokenizer_dir,
                            run_dir / "pii_report.validation.json", "data.validation")
        parts["validation"] = (val_corpus, "validation")
    elif corpus.report["splits"]["validation"]["documents"]:
        parts["validation"] = (corpus, "validation")
    notes = removal_notes(corpus.report)
    packed, manifest = {}, {"kind": "text", "contract": corpus.report, "tokenization_key": corpus.keys["train"],
                            "cache_hit": corpus.cache_hit}
    for name, (source, split) in parts.items():
        documents = load_split(source, split, len(tokenizer), d.cache_dir)
        rows, stats, chunks = pack_documents(documents, d.packed_sequence_size, pad_token_id=tokenizer.pad_token_id,
                                             policy=d.long_documents, overlap=d.long_document_overlap)
        notes += chunk_notes(chunks, name, d.packed_sequence_size, d.long_documents, d.long_document_overlap)
        packed[name] = rows
        manifest[f"{name}_documents"] = len(documents)
        manifest[f"{name}_packing"] = vars(stats)
        manifest[f"{name}_chunks"] = vars(chunks)
    if d.validation:
        manifest["validation_contract"] = parts["validation"][0].report
    # the run's data files (a chat run's are its split rows): the corpus' files by hash, not a copy of them
    _write_inputs(run_dir / "data", {name: source.inputs for name, (source, _) in parts.items()})
    manifest.setdefault("validation_documents", 0)
    manifest.setdefault("validation_packing", None)
    # the chat manifest's names, which `glmtune train` prints
    manifest |= {"train_conversations": manifest["train_documents"],
                 "validation_conversations": manifest["validation_documents"], "notes": notes}
    return TextRunData(packed["train"], packed.get("validation", []), manifest, notes)
