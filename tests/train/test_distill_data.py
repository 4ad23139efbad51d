"""Distillation's data (glmtune/train/distill_data.py): the teacher's top-K land on the packed rows'
positions of the tokens it produced; a row without a record or with a misaligned one is left out in
one counted line; mismatched tokenizers with λ > 0 and malformed records are refused in one sentence."""

import json
import math

import pytest
import torch

from glmtune.config.schema import JobConfig
from glmtune.data.packing import next_token_targets
from glmtune.data.synthetic import generate_rows
from glmtune.data.tokenizer import load_tokenizer
from glmtune.train.data_loader import collate
from glmtune.train.distill_data import (MANIFEST, check_record, distilled_conversations, open_teacher,
                                        teacher_notes)
from tests.train.distill_teacher import K, build_teacher_dir


@pytest.fixture(scope="module")
def teacher_rows(tmp_path_factory):
    """A teacher directory of 24 rows with random distributions: row 3 has no record, row 5 a short one."""
    directory = tmp_path_factory.mktemp("teacher")
    ids = [row["id"] for row in generate_rows(24, 0)]
    rows_file = build_teacher_dir(directory, rows=24, skip=(ids[3],), short=(ids[5],), model=False)
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
    n = reader.get(shortened)[0].shape[0]
    assert notes == [
        f"left out 1 training rows with no top-K record for its id (first: {skipped}); they need the teacher's "
        "record (distill.weight: 0 trains on every row, sequence-level)",
        f"left out 1 training rows with a record whose positions are not its answer's tokens (first: {shortened} "
        f"({n} vs {n + 1})); they need the teacher's record (distill.weight: 0 trains on every row, sequence-level)",
    ]
    assert stats.num_packed_samples == len(ids) - 2
    batch = collate(packed)
    assert batch["teacher_ids"].shape == (*batch["targets"].shape, K)
    # Every teacher position predicts the token the teacher emitted there; elsewhere zeros.
    emitted = torch.cat([reader.generated(i) for i in ids if i not in (skipped, shortened)])
    assert sorted(batch["targets"][batch["teacher_mask"]].tolist()) == sorted(emitted.tolist())
    for row in packed:
        targets = next_token_targets(row["labels"])
        assert all(targets[p] != -100 for p in row["teacher_positions"])
    assert (batch["teacher_ids"][~batch["teacher_mask"]] == 0).all()
    assert (batch["teacher_logps"][~batch["teacher_mask"]] == 0).all()
    # the packed top-K are the records' own, in order (one packed row of documents in first-fit order)
    records = {i: reader.get(i) for i in ids if i not in (skipped, shortened)}
    packed_logps = sorted(batch["teacher_logps"][batch["teacher_mask"]].sum(-1).tolist())
    assert packed_logps == sorted(torch.cat([lp for _, lp in records.values()]).sum(-1).tolist())


def test_mismatched_tokenizer_with_kl_is_refused_sequence_level_is_not(teacher_rows, tmp_path):
    rows_file, _ = teacher_rows
    other = tmp_path / "teacher"
    other.mkdir()
    (other / "rows.jsonl").write_text(rows_file.read_text())
    (other / MANIFEST).write_text(json.dumps({"tokenizer_sha256": "0" * 64}))
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
