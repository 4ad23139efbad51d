"""The replay mix's data (`data.replay`): the replay source as a recipe of its own, and the two sources' rows.

A replay source is prepared exactly as a run's own data of its kind would be (`run_data.prepare_data`
with the recipe `replay_config` derives): the same contract, PII policy, dedup, split and packing,
through the same tokenizer and packed row length. Its files are written under `<run_dir>/data/replay/`,
beside the domain's. `MixSources` is what the mixed loader (mix_loader.py) and the per-source
validation need: which training rows came from which source, the weights, each source's
validation rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from glmtune.config import JobConfig

DOMAIN, REPLAY = "domain", "replay"  # the sources' names in the metrics (mix/domain, val_loss/replay)


@dataclass
class MixSources:
    names: tuple[str, ...]  # the sources, the run's own data first
    weights: tuple[float, ...]  # each one's share of the training target tokens (summing to 1)
    row_sources: list[int]  # for each training row (the sources' rows concatenated), its source's index
    val_rows: dict[str, list[dict[str, Any]]]  # each source's validation rows (possibly none)


def replay_config(cfg: JobConfig) -> JobConfig:
    """The recipe that prepares `data.replay` alone: the data section with the replay's kind, files and
    generator; the file format by suffix (`auto`), no JSON schema (the run's answers' schema is not the
    general data's), each document's file as its source (the domain's `source_field` need not exist in
    general data). Every other data key (split, PII policy, packing, the other kind's keys at their
    defaults, which validation keeps them at) is the run's."""
    r = cfg.data.replay
    assert r is not None
    data = dataclasses.replace(cfg.data, kind=r.kind, train=list(r.train), validation=list(r.validation),
                               synthetic=r.synthetic, format="auto", json_schema=None, source_field=None, replay=None)
    return dataclasses.replace(cfg, data=data)


def target_tokens(row: dict[str, Any]) -> int:
    """A packed row's training targets: the positions whose next label is scored (the loss's unit)."""
    return sum(1 for label in row["labels"][1:] if label != -100)


def mix_sources(domain_rows: list, replay_rows: list, weight: float, domain_val: list,
                replay_val: list) -> MixSources:
    """The two sources' rows as the mixed loader reads them: the domain's rows, then the replay's."""
    return MixSources(names=(DOMAIN, REPLAY), weights=(1.0 - weight, weight),
                      row_sources=[0] * len(domain_rows) + [1] * len(replay_rows),
                      val_rows={DOMAIN: domain_val, REPLAY: replay_val})


def mix_notes(replay_manifest: dict[str, Any], weight: float, replay_notes: list[str], domain_rows: list,
              replay_rows: list) -> list[str]:
    """The console lines of a mixed run's data: the replay's size, its weight and the share of the rows that
    weight comes to (rows of few targets, a chat source's, take many rows for their share), then the
    replay's own filters' lines."""
    packing = replay_manifest["train_packing"]
    unit = "documents" if replay_manifest.get("kind") == "text" else "conversations"
    per_row = [sum(map(target_tokens, rows)) / max(len(rows), 1) for rows in (domain_rows, replay_rows)]
    rows_each = [(1 - weight) / max(per_row[0], 1e-9), weight / max(per_row[1], 1e-9)]
    row_share = rows_each[1] / sum(rows_each)
    line = (f"replay mix: {1 - weight:.2f} domain / {weight:.2f} replay of the training target tokens, about "
            f"{row_share:.0%} of the rows replay (targets per row: domain {per_row[0]:.0f}, replay "
            f"{per_row[1]:.0f}); replay: {replay_manifest['train_conversations']} train / "
            f"{replay_manifest['validation_conversations']} validation {unit} -> {packing['num_rows']} packed "
            f"rows ({packing['num_tokens']:,} tokens)")
    return [line, *(f"replay: {note}" for note in replay_notes)]
