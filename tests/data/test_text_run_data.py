"""A text recipe's data section to packed rows (glmtune/data/text_run_data.py, what `glmtune train` and
`glmtune plan` call for data.kind: text): the manifest's contract report, data.validation files,
data.pii: fail naming the document, and a split that leaves nothing to train on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from glmtune.config import load_config
from glmtune.data.text_run_data import prepare_text_data

KEY = "sk-" + "Q1w2E3r4T5y6U7i8O9p0A1s2"  # an API key shape pii.py flags (built so no scanner flags this file)


def _corpus(path: Path, n: int, *, secret_at: int | None = None) -> Path:
    rows = [{"text": f"Manual {i}: hold the reset button of unit {i} for {i % 7 + 3} seconds."
             + (f" Portal key {KEY}." if i == secret_at else ""), "source": f"m{i % 9}"} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, ["--data.kind", "text", "--data.source_field", "source", "--data.packed_sequence_size",
                              "32", "--data.cache_dir", str(tmp_path / "cache"), *overrides])


def test_manifest_reports_the_contract_and_packing(tmp_path: Path, tiny_tokenizer) -> None:
    train = _corpus(tmp_path / "train.jsonl", 60)
    cfg = _cfg(tmp_path, "--data.train", f"[{train}]", "--data.split", "{train: 0.6, validation: 0.4}")
    data = prepare_text_data(cfg, tmp_path, None, tiny_tokenizer)
    contract = data.manifest["contract"]
    assert contract["input"]["documents"] == 60
    splits = contract["splits"]
    assert splits["train"]["documents"] == data.manifest["train_documents"] > 0
    assert splits["validation"]["documents"] == data.manifest["validation_documents"] > 0
    assert data.manifest["train_packing"]["num_tokens"] == splits["train"]["tokens"] + splits["train"]["documents"]
    assert data.train_rows and data.val_rows and all(len(r["input_ids"]) == 32 for r in data.train_rows)
    assert json.loads((tmp_path / "pii_report.json").read_text())["num_findings"] == 0


def test_validation_files_are_the_validation_documents(tmp_path: Path, tiny_tokenizer) -> None:
    train, val = _corpus(tmp_path / "train.jsonl", 30), _corpus(tmp_path / "val.jsonl", 5)
    cfg = _cfg(tmp_path, "--data.train", f"[{train}]", "--data.validation", f"[{val}]")
    data = prepare_text_data(cfg, tmp_path, None, tiny_tokenizer)
    assert (data.manifest["train_documents"], data.manifest["validation_documents"]) == (30, 5)


def test_pii_fail_names_the_document_after_writing_the_report(tmp_path: Path, tiny_tokenizer) -> None:
    train = _corpus(tmp_path / "train.jsonl", 20, secret_at=7)
    cfg = _cfg(tmp_path, "--data.train", f"[{train}]", "--data.pii", "fail")
    with pytest.raises(ValueError, match=rf"^{train}:8: text: api_key \(sk-Q\.\.\.\(27 chars\)\) \(and 0 more "
                                         r"findings; data.pii is 'fail'"):
        prepare_text_data(cfg, tmp_path, None, tiny_tokenizer)
    assert json.loads((tmp_path / "pii_report.json").read_text())["num_findings"] == 1


def test_nothing_left_to_train_on_is_one_sentence(tmp_path: Path, tiny_tokenizer) -> None:
    train = _corpus(tmp_path / "train.jsonl", 10)
    cfg = _cfg(tmp_path, "--data.train", f"[{train}]", "--data.min_document_tokens", "500")
    with pytest.raises(ValueError, match=r"data.train: no train documents left \(10 read; removed 10 of 10 "
                                         r"documents \(\d+ tokens\): too_short\)"):
        prepare_text_data(cfg, tmp_path, None, tiny_tokenizer)


def test_the_runs_data_folder_records_the_corpus_files(tmp_path: Path, tiny_tokenizer) -> None:
    """RUN_DIR/data/text_inputs.json (what `glmtune release` records as the run's data files, as a chat
    run's split rows are): every input file of data.train and data.validation, folders expanded, with
    its source name, size and sha256; the same on a cache hit, and a changed file changes its hash."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    train, more = _corpus(folder / "a.jsonl", 30), _corpus(folder / "b.jsonl", 12)
    val = _corpus(tmp_path / "val.jsonl", 5)
    cfg = _cfg(tmp_path, "--data.train", f"[{folder}]", "--data.validation", f"[{val}]")
    runs = [tmp_path / "run1", tmp_path / "run2"]
    for run_dir in runs:  # the second: a cache hit
        (run_dir / "data").mkdir(parents=True)
        prepare_text_data(cfg, run_dir, None, tiny_tokenizer)
    recorded = [json.loads((run_dir / "data" / "text_inputs.json").read_text()) for run_dir in runs]
    assert recorded[0] == recorded[1]
    files = {split: [(f["path"], f["source"], f["bytes"], f["sha256"]) for f in entries]
             for split, entries in recorded[0].items()}
    assert files == {"train": [(str(p), p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
                               for p in (train, more)],
                     "validation": [(str(val), val.name, val.stat().st_size,
                                     hashlib.sha256(val.read_bytes()).hexdigest())]}
    more.write_text(more.read_text() + json.dumps({"text": "One more manual line.", "source": "m1"}) + "\n")
    prepare_text_data(cfg, runs[1], None, tiny_tokenizer)
    changed = json.loads((runs[1] / "data" / "text_inputs.json").read_text())["train"][1]
    assert changed["sha256"] == hashlib.sha256(more.read_bytes()).hexdigest() != files["train"][1][3]
