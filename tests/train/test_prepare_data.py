"""`prepare_data` (what `glmtune train` trains on): the contract, empty inputs, dedup and
packing filters, each counted in the notes the console prints and in the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.config import load_config
from glmtune.train.run_data import prepare_data

VOCAB_SIZE = 4096  # the tiny preset's; the bundled tokenizer fits


def chat(user: str, answer: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], **extra}


def write(path: Path, rows: list[dict | bytes]) -> Path:
    path.write_bytes(b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows))
    return path


def prepare(tmp_path: Path, train: list[Path], validation: list[Path] = (), *overrides: str):
    cfg = load_config(None, ["--data.packed_sequence_size=64", f"--data.cache_dir={tmp_path / 'cache'}",
                             *overrides])
    cfg.data.train = [str(p) for p in train]
    cfg.data.validation = [str(p) for p in validation]
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return prepare_data(cfg, run_dir, None, VOCAB_SIZE)


SHORT = [chat(f"question {i}", f"answer {i}") for i in range(3)]
LONG = chat("long question", " ".join(f"word{i}" for i in range(200)))


def test_an_invalid_utf8_row_fails_the_run_like_any_contract_violation(tmp_path):
    undecodable = write(tmp_path / "utf8.jsonl", [*SHORT, b'{"messages": "caf\xe9"}'])
    unterminated = write(tmp_path / "order.jsonl", [*SHORT, {"messages": [{"role": "user", "content": "q"}]}])
    header = "1 data contract violation(s) (run `glmtune data validate` for all); the first: "
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [unterminated])
    assert str(info.value) == header + (f"{unterminated}:4: messages[0].role: conversation must end with an "
                                        "assistant turn, not 'user'")
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [undecodable])
    assert str(info.value) == header + f"{undecodable}:4: <row>: not valid UTF-8 (byte 0xe9 at column 18)"
    # Refused before anything was written for training: no split files, no tokenized cache.
    assert list((tmp_path / "run" / "data").iterdir()) == [] and not (tmp_path / "cache").exists()


def test_empty_training_and_validation_data_are_refused(tmp_path):
    empty = write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [empty])
    assert str(info.value) == f"data.train: no rows in {empty} (empty, or only blank lines): nothing to train on"
    train = write(tmp_path / "train.jsonl", SHORT)
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [train], [empty])
    assert str(info.value) == (f"data.validation: no rows in {empty} (empty, or only blank lines); leave "
                               "data.validation empty to carve validation rows from data.train")


def test_a_filter_that_leaves_nothing_is_named(tmp_path):
    leaky = write(tmp_path / "leaky.jsonl", [chat("mail me at x@example.com", "ok")])
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [leaky], [], "--data.pii=drop")
    assert str(info.value) == (f"data.pii is 'drop' and every one of the 1 training rows has secret/PII findings "
                               f"(report in {tmp_path / 'run' / 'pii_report.json'}): nothing left to train on")

    long_only = write(tmp_path / "long.jsonl", [LONG])
    validation = write(tmp_path / "val.jsonl", SHORT[:1])
    with pytest.raises(ValueError, match=r"^nothing left to train on: dropped 1 of 1 training conversations longer "
                                         r"than data.packed_sequence_size 64 \(data.too_long: drop; longest \d+ "
                                         r"tokens\); raise data.packed_sequence_size or set data.too_long: truncate$"):
        prepare(tmp_path, [long_only], [validation])

    one_group = write(tmp_path / "group.jsonl", [chat(f"q{i}", "a", group="acme") for i in range(3)])
    # seed 1 sends group "acme" to validation at these ratios (the split hashes the group with the seed)
    with pytest.raises(ValueError) as info:
        prepare(tmp_path, [one_group], [], "--data.split={train: 0.5, validation: 0.5}", "--train.seed=1")
    assert str(info.value).startswith("data.split {'train': 0.5, 'validation': 0.5} sent all 3 rows to "
                                      "validation/test")


def test_rows_dropped_or_truncated_for_length_are_counted_in_notes(tmp_path):
    train = write(tmp_path / "train.jsonl", [*SHORT, LONG])
    validation = write(tmp_path / "val.jsonl", [SHORT[0], LONG])

    dropped = prepare(tmp_path, [train], [validation])
    longest = dropped.manifest["train_packing"]["longest_sample"]
    assert longest > 64 and dropped.manifest["validation_packing"]["longest_sample"] == longest
    assert dropped.notes == [
        f"dropped 1 of 4 training conversations longer than data.packed_sequence_size 64 "
        f"(data.too_long: drop; longest {longest:,} tokens)",
        f"dropped 1 of 2 validation conversations longer than data.packed_sequence_size 64 "
        f"(data.too_long: drop; longest {longest:,} tokens)",
    ]
    assert dropped.manifest["notes"] == dropped.notes
    assert dropped.manifest["train_packing"]["num_dropped_too_long"] == 1
    assert dropped.manifest["train_packing"]["num_packed_samples"] == 3

    truncated = prepare(tmp_path, [train], [validation], "--data.too_long=truncate")
    assert truncated.notes[0] == (f"truncated 1 of 4 training conversations longer than data.packed_sequence_size 64 "
                                  f"to their first 64 tokens (data.too_long: truncate; longest {longest:,} tokens)")
    assert truncated.manifest["train_packing"]["num_packed_samples"] == 4

    without_targets = write(tmp_path / "late.jsonl", [*SHORT, chat(LONG["messages"][1]["content"], "late answer")])
    late = prepare(tmp_path, [without_targets], [validation], "--data.too_long=truncate")
    assert late.notes[1] == ("dropped 1 of 4 training conversations with no assistant token left to train on "
                             "after truncation")


def test_exact_duplicates_are_removed_and_counted_normalized_ones_kept(tmp_path):
    rows = [*SHORT, dict(SHORT[0], id="again"), SHORT[1], chat("QUESTION 0!", "answer 0")]
    train = write(tmp_path / "train.jsonl", rows)
    validation = write(tmp_path / "val.jsonl", SHORT[:1])
    data = prepare(tmp_path, [train], [validation])
    assert data.notes == ["removed 2 exact duplicate conversations (kept the first of each; 4 left)"]
    assert data.manifest["filters"] == {"input_rows": 6, "pii_dropped": 0, "exact_duplicates": 2}
    assert data.manifest["train_conversations"] == 4
    trained = [json.loads(line) for line in Path(data.manifest["train_file"]).read_text().splitlines()]
    assert [row["messages"][0]["content"] for row in trained] == ["question 0", "question 1", "question 2",
                                                                  "QUESTION 0!"]
