"""Distillation's data (`train.objective: distill`): a teacher directory's rows, packed as SFT packs
them, each packed row carrying the teacher's top-K at the positions whose tokens the teacher produced.

A teacher directory (`glmtune distill generate`'s, named by `data.train`: its rows file, or the
directory) holds chat rows, each with a stable `id`, whose last assistant turn is the teacher's
answer; `manifest.json` (the teacher; its `settings` name the teacher's tokenizer directory and
`tokenizer_sha256`, `data/sources.file_sha256` of it); and the sidecar `topk/` (`glmtune/distill/topk_store.py`), one record
per row id: n positions of K ids and log-probabilities, the teacher's distribution before each token
of its answer it emitted (and that token).

With `distill.weight` 0 the run is sequence-level distillation: SFT on the rows, exactly (the
sidecar is not read). With λ > 0:
  * the student's tokenizer must be the teacher's (the manifest's hash against the student's
    tokenizer files): token ids of one are not the other's; refused in one sentence otherwise.
  * every row is aligned before anything trains: the rendered row (the chat template, tokenized
    through the cache as SFT does) must supervise n tokens in its last assistant turn (the last run
    of supervised labels), or n + 1 (the end-of-turn token, whose distribution an engine that
    sampled it did not record: cross-entropy only there); the positions after the first token the
    teacher emitted otherwise than the row renders it (its context differs from there on) are left
    out of the KL (counted), a row without a record or with another
    count is left out of the run (one line, counted, the first such row named). A record that is
    not a distribution (NaN, +inf or positive log-probabilities, an id outside the student's
    vocabulary, an id twice at one position) stops the run, naming the row.
  * packed rows carry `teacher_positions` (target positions: position t predicts token t + 1) and
    [n, K] `teacher_ids` / `teacher_logps`; the loader packs them like the targets
    (`data_loader.collate`: [B, T, K], zeros and a mask elsewhere). Absent entries of a record (id
    -1, log-prob -inf: the engine returned fewer than K) are given a present id of their position
    and stay -inf: they add nothing to either side of the KL.

The teacher's top-K are held in host memory with the packed rows (12 bytes x K per answer token at
fp32); the sidecar is read again on every start (resume included), never saved in a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glmtune.config import JobConfig
from glmtune.data.chat_template import IGNORE_INDEX, TokenizedSample, last_turn_span
from glmtune.data.packing import first_fit_decreasing, pack_samples
from glmtune.data.sources import file_sha256, read_rows
from glmtune.data.token_cache import tokenize_dataset, tokenizer_sha256
from glmtune.data.tokenizer import resolve_tokenizer_dir
from glmtune.distill.topk_store import TopKReader
from glmtune.io.json_file import read_json_file
from glmtune.models.common.microbatch import TEACHER_IDS, TEACHER_LOGPS

MANIFEST, SIDECAR = "manifest.json", "topk"


@dataclass
class Teacher:
    """What one row of the teacher gives the student: (target positions in the sample, ids [n, K],
    log-probs [n, K]); the rows left out and the positions masked, for the run's notes."""

    reader: TopKReader
    vocab_size: int
    left_out: dict[str, list[str]] = field(default_factory=dict)  # reason -> row ids
    disagreeing_positions: int = 0


def teacher_directory(cfg: JobConfig) -> Path:
    train = Path(cfg.data.train[0])
    return train if train.is_dir() else train.parent


def open_teacher(cfg: JobConfig, tokenizer_dir: Path | None, vocab_size: int) -> Teacher | None:
    """The teacher directory's sidecar for a run with distill.weight > 0 (None at 0: sequence-level),
    refused in one sentence when the directory has no manifest or sidecar, or when its tokenizer is
    not the student's."""
    directory = teacher_directory(cfg)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"data.train: {directory} is not a teacher directory: no {MANIFEST} beside its rows "
                         "(glmtune distill generate writes one)")
    manifest = read_json_file(manifest_path, "teacher manifest")
    if cfg.distill.weight == 0:
        return None
    student_dir = resolve_tokenizer_dir(tokenizer_dir)
    if not same_tokenizer(manifest.get("settings"), student_dir):
        teacher_hash = (manifest.get("settings") or {}).get("tokenizer_sha256") if isinstance(
            manifest.get("settings"), dict) else None
        raise ValueError(f"distill.weight {cfg.distill.weight} needs the teacher's tokenizer, but {manifest_path}'s "
                         f"tokenizer_sha256 ({teacher_hash}) is not the student's ({student_dir}): their token ids "
                         "name different tokens; set distill.weight: 0 for sequence-level distillation")
    if not (directory / SIDECAR).is_dir():
        raise ValueError(f"distill.weight {cfg.distill.weight} reads the teacher's top-K log-probabilities, but "
                         f"{directory} has no {SIDECAR}/ sidecar (generate with --top-logprobs K, or set "
                         "distill.weight: 0)")
    return Teacher(TopKReader(directory / SIDECAR), vocab_size)


def same_tokenizer(settings: Any, student_dir: Path) -> bool:
    """Whether the manifest's `settings` (`glmtune distill generate`'s: the teacher's `tokenizer`
    directory and `tokenizer_sha256`, the sha256 of that directory's files) name the student's
    tokenizer: the same directory hash, or, where the teacher's directory still exists (a model
    directory hashes its weights too), the same tokenizer files (`token_cache.tokenizer_sha256`)."""
    if not isinstance(settings, dict):
        return False
    if settings.get("tokenizer_sha256") == file_sha256(student_dir):
        return True
    teacher_dir = Path(str(settings.get("tokenizer", "")))
    return bool(settings.get("tokenizer")) and teacher_dir.is_dir() and \
        tokenizer_sha256(teacher_dir) == tokenizer_sha256(student_dir)


def last_turn_targets(labels: list[int]) -> list[int]:
    """Label indices of the last run of supervised labels (the last assistant turn's tokens)."""
    return list(range(*last_turn_span(labels)))


def check_record(row_id: str, ids_NK: torch.Tensor, logps_NK: torch.Tensor, vocab_size: int) -> None:
    """A ValueError naming the row when its record is not a top-K distribution over the vocabulary."""
    present = ids_NK >= 0
    problems = [
        (torch.isnan(logps_NK).any(), "a NaN log-probability"),
        ((logps_NK > 0).any(), "a log-probability above 0 (or +inf)"),
        ((ids_NK >= vocab_size).any(), f"a token id >= the student's vocabulary size {vocab_size}"),
        ((ids_NK < -1).any() | (~present & torch.isfinite(logps_NK)).any(), "an id below 0 with a log-probability"),
        (_repeated(ids_NK), "one token id twice at one position"),
    ]
    for bad, what in problems:
        if bool(bad):
            raise ValueError(f"teacher top-K of row {row_id!r}: {what}; the record is not the teacher's "
                             "distribution (regenerate it)")


def _repeated(ids_NK: torch.Tensor) -> bool:
    ordered = ids_NK.sort(dim=-1).values
    return bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())


def _filled(ids_NK: torch.Tensor, logps_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absent entries (id -1) given their position's first id, their log-prob kept at -inf: the KL's
    gather and bucket see a present id with no mass (distill_loss.py)."""
    first = ids_NK.gather(1, (ids_NK >= 0).int().argmax(dim=1, keepdim=True))
    return torch.where(ids_NK >= 0, ids_NK, first), logps_NK


def align(teacher: Teacher, row_id: Any, sample: TokenizedSample) -> tuple | None:
    """(target positions, ids, log-probs) of one row, or None: the row is left out (`teacher.left_out`)."""
    if not isinstance(row_id, str) or row_id not in teacher.reader:
        teacher.left_out.setdefault("no top-K record for its id", []).append(str(row_id))
        return None
    ids, logps = teacher.reader.get(row_id)
    check_record(row_id, ids, logps, teacher.vocab_size)
    label_indices = last_turn_targets(list(sample.labels))
    if ids.shape[0] == len(label_indices) - 1:  # the end of turn not recorded (a sampled stop token): no KL there
        label_indices = label_indices[:-1]
    if len(label_indices) != ids.shape[0]:
        teacher.left_out.setdefault("a record whose positions are not its answer's tokens", []).append(
            f"{row_id} ({ids.shape[0]} vs {len(label_indices)})")
        return None
    generated = teacher.reader.generated(row_id)
    rendered = torch.tensor([sample.labels[i] for i in label_indices], dtype=torch.long)
    # The teacher's distribution at position j was conditioned on its tokens before j: where the rows
    # render another token (a re-tokenized answer), every later position's context differs.
    same = ((generated < 0) | (generated == rendered)).long()
    before_agree = torch.cat([torch.ones(1, dtype=torch.long), same.cumprod(0)[:-1]]) > 0
    agree = before_agree & (ids >= 0).any(dim=1)
    teacher.disagreeing_positions += int((~agree).sum())
    ids, logps = _filled(ids[agree], logps[agree])
    positions = [index - 1 for index, keep in zip(label_indices, agree.tolist()) if keep]  # target t -> token t+1
    return positions, ids, logps


def pack_with_teacher(samples: list[TokenizedSample], payloads: list[tuple], size: int, pad_token_id: int):
    """`pack_samples`' rows and stats (too-long samples dropped), each row given its documents'
    teacher positions and top-K, shifted to where the packer placed them."""
    rows, stats = pack_samples(samples, size, pad_token_id=pad_token_id, long_samples="drop")
    # The packer's own filter and first-fit order, replayed to learn which sample went where.
    kept = [i for i, s in enumerate(samples) if len(s.input_ids) <= size and any(
        label != IGNORE_INDEX for label in s.labels[1:])]
    bins = first_fit_decreasing([len(samples[i].input_ids) for i in kept], size)
    assert len(bins) == len(rows)
    for row, bin_indices in zip(rows, bins):
        offset, positions, ids, logps, tokens = 0, [], [], [], []
        for index in (kept[b] for b in bin_indices):
            sample_positions, sample_ids, sample_logps = payloads[index]
            positions += [offset + p for p in sample_positions]
            ids.append(sample_ids)
            logps.append(sample_logps)
            tokens += samples[index].input_ids
            offset += len(samples[index].input_ids)
        assert row["input_ids"][:offset] == list(tokens), "the packer placed the samples otherwise"
        row["teacher_positions"], row[TEACHER_IDS], row[TEACHER_LOGPS] = positions, torch.cat(ids), torch.cat(logps)
    return rows, stats


def distilled_conversations(teacher: Teacher, cfg: JobConfig, paths: list[Path], tokenizer_dir: Path | None,
                            schema, tokenizer):
    """`run_data._conversations` for a distillation run: the rows tokenized through the cache as SFT's,
    aligned with the teacher's records, the unaligned left out, packed with their top-K."""
    d = cfg.data
    tokenized = tokenize_dataset(paths, tokenizer_dir=tokenizer_dir, loss_on=d.loss_on,
                                 enable_thinking=d.enable_thinking, schema=schema, cache_dir=d.cache_dir,
                                 vocab_size=len(tokenizer))
    row_ids = [row.data.get("id") for row in read_rows(paths)]
    assert len(row_ids) == len(tokenized.samples)
    samples, payloads = [], []
    for row_id, sample in zip(row_ids, tokenized.samples):
        payload = align(teacher, row_id, sample)
        if payload is not None:
            samples.append(sample)
            payloads.append(payload)
    if not samples:
        raise ValueError(f"no row of {', '.join(map(str, paths))} has the teacher's top-K: "
                         f"{'; '.join(teacher_notes(teacher, 'data'))}")
    rows, stats = pack_with_teacher(samples, payloads, d.packed_sequence_size, tokenizer.pad_token_id)
    stats.num_samples = len(row_ids)
    return tokenized, rows, stats


def teacher_notes(teacher: Teacher, split: str) -> list[str]:
    """One line per reason rows were left out (counted, the first named), and the masked positions."""
    notes = [f"left out {len(ids):,} {split} rows with {reason} (first: {ids[0]}); they need the teacher's "
             "record (distill.weight: 0 trains on every row, sequence-level)" for reason, ids in teacher.left_out.items()]
    if teacher.disagreeing_positions:
        notes.append(f"{teacher.disagreeing_positions:,} {split} answer tokens come after a token the teacher emitted "
                     "otherwise than the rows render it: no KL there (cross-entropy only)")
    teacher.left_out, teacher.disagreeing_positions = {}, 0
    return notes
