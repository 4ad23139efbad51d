"""The run's data, from the recipe's `data` section to packed rows (step 4 of `glmtune train`).

`prepare_data` reads, checks, filters, splits, tokenizes and packs: synthetic generation,
the data contract (every row, before anything trains), the PII policy, exact dedup, the
group-aware split, tokenization through the cache, packing. `glmtune plan` uses it too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.config import JobConfig
from glmtune.data.chat_template import control_tokens, load_chat_template
from glmtune.data.contract import check_or_raise, load_schema
from glmtune.data.dedup import dedup_rows
from glmtune.data.packing import pack_pairs, pack_samples
from glmtune.data.pii import build_report, lint_rows
from glmtune.data.preferences import check_preferences_or_raise
from glmtune.data.sources import check_format, no_rows_message, read_rows
from glmtune.data.split import split_rows
from glmtune.data.synthetic import generate_rows, write_jsonl
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.text_run_data import prepare_text_data
from glmtune.data.token_cache import tokenize_dataset, tokenize_preference_dataset
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.train.distill_data import distilled_conversations, open_teacher, teacher_notes
from glmtune.train.mix_data import MixSources, mix_notes, mix_sources, replay_config


@dataclass
class PreparedData:
    train_rows: list[dict[str, list[int]]]
    val_rows: list[dict[str, list[int]]]
    val_conversations: list[dict[str, Any]]
    manifest: dict[str, Any]
    notes: list[str]  # one console line per thing the filters removed or changed (also in the manifest)
    # a replay mix (data.replay): the sources of the training rows (the domain's, then the replay's), their
    # weights and validation rows; train_rows/val_rows/val_conversations/manifest are then the domain's
    # (val_rows, manifest) with the replay's training rows appended to train_rows. None: one source.
    mix: MixSources | None = None


def _write_jsonl(rows: list[dict[str, Any]], directory: Path, split: str) -> Path:
    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    path = directory / f"{split}-{digest}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(body)
        tmp.replace(path)
    return path


def prepare_data(cfg: JobConfig, run_dir: Path, tokenizer_dir: Path | None, vocab_size: int) -> PreparedData:
    """Read, check, filter, split, tokenize and pack the recipe's data.

    Every training row must pass the data contract (a bad row, an undecodable line
    included, fails the run before anything trains, listed as file:line). Then, in
    `glmtune data prepare`'s order: the PII policy, exact dedup (only exact: see
    dedup.py), the group split, and packing with `data.too_long`. What each filter
    removed is counted in the manifest and described in `notes`; a filter that
    leaves nothing to train on is a ValueError naming it. A replay mix prepares each source so (`_mixed`).
    """
    if cfg.data.replay is not None:
        return _mixed(cfg, run_dir, tokenizer_dir, vocab_size)
    d = cfg.data
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    if d.kind == "text":  # raw documents: their own reader, contract and packing (text_run_data.py)
        return _text(cfg, run_dir, tokenizer_dir, vocab_size)
    notes: list[str] = []
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    # the contract's control tokens are the template's and tokenizer's, as tokenization checks them again
    forbidden = control_tokens(load_chat_template(resolve_tokenizer_dir(tokenizer_dir)), tokenizer)
    rows, filters, schema = _checked_rows(cfg, data_dir, run_dir, notes, forbidden)
    train_data, val_data, val_paths = _split(cfg, rows, data_dir, schema, forbidden)
    train_file = _write_jsonl(train_data, data_dir, "train")
    tokenize_and_pack = _pairs if cfg.train.objective == "dpo" else _conversations
    teacher = open_teacher(cfg, tokenizer_dir, vocab_size) if cfg.train.objective == "distill" else None
    if teacher is not None:  # distillation with λ > 0: rows aligned with the teacher's top-K (distill_data.py)
        tokenize_and_pack = functools.partial(distilled_conversations, teacher)
    train_tok, train_rows, train_stats = tokenize_and_pack(cfg, [train_file], tokenizer_dir, schema, tokenizer)
    notes += teacher_notes(teacher, "training") if teacher is not None else []
    unit = "pairs" if cfg.train.objective == "dpo" else "conversations"
    packing_notes = _packing_notes(train_stats, f"training {unit}", d.packed_sequence_size, d.too_long)
    if not train_rows:
        truncate = train_stats.num_dropped_too_long and cfg.train.objective != "dpo"
        advice = "; raise data.packed_sequence_size" + (" or set data.too_long: truncate" if truncate else "")
        raise ValueError(f"nothing left to train on: {'; '.join(packing_notes)}{advice}")
    notes += packing_notes
    val_rows, val_stats = [], None
    if val_paths:
        _, val_rows, val_stats = tokenize_and_pack(cfg, val_paths, tokenizer_dir, schema, tokenizer)
        notes += teacher_notes(teacher, "validation") if teacher is not None else []
        notes += _packing_notes(val_stats, f"validation {unit}", d.packed_sequence_size, d.too_long)
    manifest = {
        "train_file": str(train_file), "train_conversations": len(train_data),
        "validation_conversations": len(val_data), "validation_files": [str(p) for p in val_paths],
        "tokenization_key": train_tok.key,
        "cache_hit": train_tok.cache_hit,
        "filters": filters,
        "train_packing": vars(train_stats), "validation_packing": vars(val_stats) if val_stats else None,
        "notes": notes,
    }
    return PreparedData(train_rows, val_rows, val_data, manifest, notes)


def _mixed(cfg: JobConfig, run_dir: Path, tokenizer_dir: Path | None, vocab_size: int) -> PreparedData:
    """The run's own data and `data.replay`'s (mix_data.replay_config: its files under run_dir/data/replay),
    each prepared alone; the training rows of both, the domain's validation, the mix's sources."""
    assert cfg.data.replay is not None
    weight = cfg.data.replay.weight
    domain = prepare_data(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, replay=None)), run_dir,
                          tokenizer_dir, vocab_size)
    replay_dir = run_dir / "data" / "replay"  # under data/, where a training writes its data files
    replay_dir.mkdir(parents=True, exist_ok=True)
    replay = prepare_data(replay_config(cfg), replay_dir, tokenizer_dir, vocab_size)
    mix = mix_sources(domain.train_rows, replay.train_rows, weight, domain.val_rows, replay.val_rows)
    notes = domain.notes + mix_notes(replay.manifest, weight, replay.notes, domain.train_rows, replay.train_rows)
    manifest = {**domain.manifest, "notes": notes, "replay": replay.manifest,
                "mix": {"sources": list(mix.names), "weights": list(mix.weights), "unit": "target tokens"}}
    return PreparedData(domain.train_rows + replay.train_rows, domain.val_rows, domain.val_conversations,
                        manifest, notes, mix)


def _text(cfg: JobConfig, run_dir: Path, tokenizer_dir: Path | None, vocab_size: int) -> PreparedData:
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    text = prepare_text_data(cfg, run_dir, tokenizer_dir, tokenizer)
    return PreparedData(text.train_rows, text.val_rows, [], text.manifest, text.notes)


def _conversations(cfg: JobConfig, paths: list[Path], tokenizer_dir: Path | None, schema, tokenizer):
    """Chat rows tokenized through the cache (an entry with ids beyond the tokenizer is refused) and
    packed: (tokenized, rows, stats)."""
    d = cfg.data
    tokenized = tokenize_dataset(paths, tokenizer_dir=tokenizer_dir, loss_on=d.loss_on,
                                 enable_thinking=d.enable_thinking, schema=schema, cache_dir=d.cache_dir,
                                 vocab_size=len(tokenizer))
    rows, stats = pack_samples(tokenized.samples, d.packed_sequence_size, pad_token_id=tokenizer.pad_token_id,
                               long_samples=d.too_long)
    return tokenized, rows, stats


def _pairs(cfg: JobConfig, paths: list[Path], tokenizer_dir: Path | None, schema, tokenizer):
    """Preference rows tokenized through the cache and packed a pair to a row's two documents."""
    d = cfg.data
    tokenized = tokenize_preference_dataset(paths, tokenizer_dir=tokenizer_dir, enable_thinking=d.enable_thinking,
                                            schema=schema, cache_dir=d.cache_dir, vocab_size=len(tokenizer))
    rows, stats = pack_pairs(tokenized.pairs, d.packed_sequence_size, pad_token_id=tokenizer.pad_token_id)
    return tokenized, rows, stats


def _checked_rows(cfg: JobConfig, data_dir: Path, run_dir: Path, notes: list[str],
                  forbidden: tuple[str, ...]) -> tuple[list, dict, Any]:
    """The training rows (the synthetic ones written first), every one through the contract (no
    string holding a `forbidden` control token), then the PII policy and exact dedup; the counts
    the manifest's `filters` records; the JSON schema."""
    d = cfg.data
    train_paths = [Path(p) for p in d.train]
    if d.synthetic is not None:
        synthetic = data_dir / f"synthetic-{d.synthetic.kind}-{d.synthetic.rows}-seed{d.synthetic.seed}.jsonl"
        if not synthetic.exists():  # written under a temporary name: a killed run leaves no partial file
            tmp = synthetic.with_suffix(".partial")
            generate = generate_preference_rows if d.synthetic.kind == "support_preferences" else generate_rows
            write_jsonl(generate(d.synthetic.rows, d.synthetic.seed), tmp)
            tmp.replace(synthetic)
        train_paths.append(synthetic)
    if not train_paths:
        raise ValueError("data.train is empty and data.synthetic is not set: nothing to train on")
    check_format([*d.train, *d.validation], d.format)
    schema = load_schema(d.json_schema) if d.json_schema else None
    rows = _row_check(cfg)(read_rows(train_paths), schema, control_tokens=forbidden)  # every row, before training
    if not rows:
        raise ValueError(f"data.train: {no_rows_message(train_paths)}: nothing to train on")
    num_input_rows = len(rows)
    rows = _apply_pii_policy(rows, d.pii, run_dir, notes)
    num_pii_dropped = num_input_rows - len(rows)
    rows, dedup_stats = dedup_rows(rows, normalized=False)
    if dedup_stats.num_exact_duplicates:
        notes.append(f"removed {dedup_stats.num_exact_duplicates:,} exact duplicate conversations "
                     f"(kept the first of each; {len(rows):,} left)")
    return rows, {"input_rows": num_input_rows, "pii_dropped": num_pii_dropped,
                  "exact_duplicates": dedup_stats.num_exact_duplicates}, schema


def _row_check(cfg: JobConfig):
    """The data contract for the objective's rows: chat rows (SFT) or preference rows (DPO)."""
    return check_preferences_or_raise if cfg.train.objective == "dpo" else check_or_raise


def _split(cfg: JobConfig, rows: list, data_dir: Path, schema,
           forbidden: tuple[str, ...]) -> tuple[list, list, list[Path]]:
    """(training conversations, validation conversations, validation files): data.validation's
    files, else the group-aware split of the training rows (its validation part written out)."""
    d = cfg.data
    if d.validation:
        val_paths = [Path(p) for p in d.validation]
        val_data = [r.data for r in _row_check(cfg)(read_rows(val_paths), schema, control_tokens=forbidden)]
        if not val_data:
            raise ValueError(f"data.validation: {no_rows_message(val_paths)}; "
                             "leave data.validation empty to carve validation rows from data.train")
        return [r.data for r in rows], val_data, val_paths
    ratios = (d.split.get("train", 0.0), d.split.get("validation", 0.0), d.split.get("test", 0.0))
    parts = split_rows(rows, ratios, seed=cfg.train.seed)
    train_data = [r.data for r in parts["train"]]
    val_data = [r.data for r in parts["validation"]]
    if not train_data:
        raise ValueError(f"data.split {d.split} sent all {len(rows):,} rows to validation/test (rows of one "
                         "`group` stay together, so few groups split coarsely): nothing left to train on; "
                         "add rows or give data.validation files")
    return train_data, val_data, [_write_jsonl(val_data, data_dir, "validation")] if val_data else []


def _packing_notes(stats: Any, split: str, size: int, too_long: str) -> list[str]:
    """What packing (its PackingStats) removed or cut from one split's conversations, one line each."""
    total, longest = f"{stats.num_samples:,} {split}", f"longest {stats.longest_sample:,} tokens"
    notes = []
    if stats.num_dropped_too_long:
        notes.append(f"dropped {stats.num_dropped_too_long:,} of {total} longer than data.packed_sequence_size "
                     f"{size} (data.too_long: {too_long}; {longest})")
    if stats.num_truncated:
        notes.append(f"truncated {stats.num_truncated:,} of {total} longer than data.packed_sequence_size "
                     f"{size} to their first {size} tokens (data.too_long: {too_long}; {longest})")
    if stats.num_dropped_no_targets:
        notes.append(f"dropped {stats.num_dropped_no_targets:,} of {total} with no assistant token left to train on"
                     + (" after truncation" if stats.num_truncated else ""))
    return notes


def _apply_pii_policy(rows: list, action: str, run_dir: Path, notes: list[str]) -> list:
    """Secrets/PII lint on the training rows: report (write pii_report.json), drop the rows, or fail."""
    per_row = lint_rows(rows)
    report = build_report(per_row, action)
    report_path = run_dir / "pii_report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    if not report["num_findings"]:
        return rows
    first = next(f for findings in per_row for f in findings)
    num_flagged = report["num_rows_with_findings"]
    if action == "fail":
        raise ValueError(f"{first} (and {report['num_findings'] - 1} more findings; data.pii is 'fail'; "
                         f"report in {report_path})")
    if action == "drop":
        if num_flagged == len(rows):
            raise ValueError(f"data.pii is 'drop' and every one of the {len(rows):,} training rows has secret/PII "
                             f"findings (report in {report_path}): nothing left to train on")
        notes.append(f"dropped {num_flagged:,} of {len(rows):,} rows with secret/PII findings "
                     f"(data.pii: drop; report in {report_path})")
        return [row for row, findings in zip(rows, per_row) if not findings]
    notes.append(f"kept {num_flagged:,} rows with secret/PII findings (data.pii: report; "
                 f"{report['num_findings']:,} findings in {report_path})")
    return rows
