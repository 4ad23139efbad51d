"""Distillation's data (glmtune/train/distill_data.py): the teacher's top-K land on the packed rows'
positions of the tokens it produced; a row without a record or with a misaligned one is left out in
one counted line; mismatched tokenizers with λ > 0 and malformed records are refused in one sentence."""

import json
import math
import shutil

import pytest
import torch

from glmtune.config.schema import JobConfig
from glmtune.data.packing import next_token_targets
from glmtune.data.synthetic import generate_rows
from glmtune.data.sources import file_sha256
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.train.data_loader import collate
from glmtune.train.distill_data import (MANIFEST, check_record, distilled_conversations, open_teacher,
                                        same_tokenizer, teacher_notes)
from tests.train.distill_teacher import K, build_teacher_dir


@pytest.fixture(scope="module")
def teacher_rows(tmp_path_factory):
    """A teacher directory of 24 rows with random distributions: row 3 has no record, row 5 a short one,
    row 7 none at its end-of-turn token, row 9 emitted another third token than the row renders."""
    directory = tmp_path_factory.mktemp("teacher")
    ids = [row["id"] for row in generate_rows(24, 0)]
    rows_file = build_teacher_dir(directory, rows=24, skip=(ids[3],), short=(ids[5],), unstopped=(ids[7],),
                                  diverged=(ids[9],), model=False)
    return rows_file, ids


def _cfg(rows_file, tmp_path, weight=1.0) -> JobConfig:
    cfg = JobConfig()
    cfg.train.objective = "distill"
    cfg.distill.weight = weight
    cfg.data.train = [str(rows_file)]
    cfg.data.packed_sequence_size = 1024
    cfg.data.cache_dir = str(tmp_path / "cache")
    return cfg


def test_positions_align_and_bad_rows_are_left_out(teacher_rows, tmp_path):
    rows_file, ids = teacher_rows
    cfg = _cfg(rows_file, tmp_path)
    teacher = open_teacher(cfg, None, 4096)
    _, packed, stats = distilled_conversations(teacher, cfg, [rows_file], None, None, load_tokenizer(None))
    notes = teacher_notes(teacher, "training")
    skipped, shortened = ids[3], ids[5]
    reader = teacher.reader
    n, n9 = reader.get(shortened)[0].shape[0], reader.get(ids[9])[0].shape[0]
    assert notes == [
        f"left out 1 training rows with no top-K record for its id (first: {skipped}); they need the teacher's "
        "record (distill.weight: 0 trains on every row, sequence-level)",
        f"left out 1 training rows with a record whose positions are not its answer's tokens (first: {shortened} "
        f"({n} vs {n + 2})); they need the teacher's record (distill.weight: 0 trains on every row, sequence-level)",
        f"{n9 - 3} training answer tokens come after a token the teacher emitted otherwise than the rows render it: "
        "no KL there (cross-entropy only)",
    ]
    assert stats.num_packed_samples == len(ids) - 2  # row 7 kept: its answer's tokens but the last have a record
    batch = collate(packed)
    assert batch["teacher_ids"].shape == (*batch["targets"].shape, K)
    # Every teacher position predicts the token the teacher emitted there; elsewhere zeros.
    emitted = torch.cat([reader.generated(i)[:3 if i == ids[9] else None] for i in ids if i not in (skipped, shortened)])
    emitted[sum(len(reader.generated(i)) for i in ids[:9] if i not in (skipped, shortened)) + 2] -= 1  # row 9's
    assert sorted(batch["targets"][batch["teacher_mask"]].tolist()) == sorted(emitted.tolist())
    for row in packed:
        targets = next_token_targets(row["labels"])
        assert all(targets[p] != -100 for p in row["teacher_positions"])
    assert (batch["teacher_ids"][~batch["teacher_mask"]] == 0).all()
    assert (batch["teacher_logps"][~batch["teacher_mask"]] == 0).all()
    # the packed top-K are the records' own, in order (one packed row of documents in first-fit order)
    records = {i: reader.get(i)[1][:3 if i == ids[9] else None] for i in ids if i not in (skipped, shortened)}
    packed_logps = sorted(batch["teacher_logps"][batch["teacher_mask"]].sum(-1).tolist())
    assert packed_logps == sorted(torch.cat(list(records.values())).sum(-1).tolist())


def test_mismatched_tokenizer_with_kl_is_refused_sequence_level_is_not(teacher_rows, tmp_path):
    rows_file, _ = teacher_rows
    other = tmp_path / "teacher"
    other.mkdir()
    (other / "rows.jsonl").write_text(rows_file.read_text())
    (other / MANIFEST).write_text(json.dumps({"settings": {"tokenizer": str(other), "tokenizer_sha256": "0" * 64}}))
    with pytest.raises(ValueError, match=r"^distill.weight 1.0 needs the teacher's tokenizer, but .*manifest.json's "
                                         r"tokenizer_sha256 \(0{64}\) is not the student's .*set distill.weight: 0 "
                                         r"for sequence-level distillation$"):
        open_teacher(_cfg(other / "rows.jsonl", tmp_path), None, 4096)
    assert open_teacher(_cfg(other / "rows.jsonl", tmp_path, weight=0.0), None, 4096) is None
    (other / MANIFEST).unlink()
    with pytest.raises(ValueError, match="is not a teacher directory: no manifest.json"):
        open_teacher(_cfg(other / "rows.jsonl", tmp_path, weight=0.0), None, 4096)


@pytest.mark.parametrize("damage, message", [
    (lambda ids, lp: lp.__setitem__((0, 1), math.nan), "a NaN log-probability"),
    (lambda ids, lp: lp.__setitem__((1, 0), math.inf), r"a log-probability above 0 \(or \+inf\)"),
    (lambda ids, lp: lp.__setitem__((1, 0), 0.5), r"a log-probability above 0"),
    (lambda ids, lp: ids.__setitem__((0, 2), 4096), "a token id >= the student's vocabulary size 4096"),
    (lambda ids, lp: ids.__setitem__((0, 1), int(ids[0, 0])), "one token id twice at one position"),
    (lambda ids, lp: ids.__setitem__((0, 3), -1), "an id below 0 with a log-probability"),
])
def test_malformed_records_are_refused_naming_the_row(damage, message):
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, -1]])
    logps = torch.log(torch.tensor([[0.4, 0.2, 0.1, 0.05], [0.5, 0.2, 0.1, 0.0]]))
    check_record("row-7", ids, logps, 4096)  # as given: a distribution (an absent entry: -1, -inf)
    damage(ids, logps)
    with pytest.raises(ValueError, match=rf"^teacher top-K of row 'row-7': {message}"):
        check_record("row-7", ids, logps, 4096)


def test_same_tokenizer_by_its_files_when_the_teacher_directory_holds_more(tmp_path):
    """generate's manifest hashes the teacher's whole directory (a model directory: its weights too): the
    student's tokenizer is the teacher's when that hash or the tokenizer files match."""
    model_dir = tmp_path / "teacher-model"
    shutil.copytree(TINY_TOKENIZER_DIR, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"weights")
    settings = {"tokenizer": str(model_dir), "tokenizer_sha256": file_sha256(model_dir)}
    assert same_tokenizer(settings, TINY_TOKENIZER_DIR)
    assert same_tokenizer({"tokenizer": "/gone", "tokenizer_sha256": file_sha256(TINY_TOKENIZER_DIR)},
                          TINY_TOKENIZER_DIR)
    tokenizer_json = model_dir / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"<|user|>"', '"<|usr|>"', 1))
    assert not same_tokenizer(settings, TINY_TOKENIZER_DIR)
    assert not same_tokenizer(None, TINY_TOKENIZER_DIR)
