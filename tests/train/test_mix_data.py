"""A replay mix's data (glmtune/train/mix_data.py, run_data.prepare_data): each source prepared as a run of
its kind would prepare it, the rows of both with their sources, each source's validation rows."""

from __future__ import annotations

import json
from pathlib import Path

from glmtune.config import load_config
from glmtune.train.mix_data import replay_config, target_tokens
from glmtune.train.run_data import prepare_data

VOCAB = 4096  # the tiny model's
DOMAIN_CORPUS = "recipes/tiny/domain_text/corpus.jsonl"


def _text_replay(tmp_path: Path) -> Path:
    """A general-text replay corpus: 40 files, one document each (each file its own source)."""
    folder = tmp_path / "general"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc-{i:02d}.txt").write_text(f"General note {i}. " + "The river runs past the mill. " * (5 + i))
    return folder


def test_a_chat_domain_with_a_text_replay(tmp_path: Path) -> None:
    general = _text_replay(tmp_path)
    cfg = load_config(None, ["--data.synthetic.rows", "200", "--data.packed_sequence_size", "256",
                             "--data.replay", f"{{kind: text, train: [{general}], weight: 0.3}}",
                             "--data.split", "{train: 0.8, validation: 0.2}", "--data.cache_dir",
                             str(tmp_path / "cache")])
    data = prepare_data(cfg, tmp_path / "run", None, VOCAB)
    sources = data.mix.row_sources
    domain_rows, replay_rows = sources.count(0), sources.count(1)
    assert domain_rows and replay_rows and len(data.train_rows) == domain_rows + replay_rows
    assert sources == [0] * domain_rows + [1] * replay_rows  # the domain's rows first
    assert data.mix.weights == (0.7, 0.3) and data.mix.names == ("domain", "replay")
    # the text replay: every token of a document a target but its first; chat rows: the answers only
    replay_targets = sum(map(target_tokens, data.train_rows[domain_rows:]))
    replay_real = sum(sum(1 for d in row["document_ids"] if d >= 0) for row in data.train_rows[domain_rows:])
    assert replay_targets > 0.9 * replay_real
    assert data.val_rows == data.mix.val_rows["domain"] and data.mix.val_rows["replay"]
    assert data.manifest["replay"]["kind"] == "text" and data.manifest["mix"]["weights"] == [0.7, 0.3]
    assert data.manifest["train_conversations"] < 200 and "contract" in data.manifest["replay"]
    assert data.val_conversations  # the domain's held-out chat prompts (train.generate_samples reads them)
    assert json.loads((tmp_path / "run" / "data" / "replay" / "pii_report.json").read_text())["num_findings"] == 0


def test_the_replay_recipe_is_its_kinds_own(tmp_path: Path) -> None:
    cfg = load_config("recipes/tiny/cpt_domain_text_replay.yaml", ["--data.replay.synthetic.rows", "50"])
    replay = replay_config(cfg).data
    assert (replay.kind, replay.train, replay.synthetic.rows, replay.replay) == ("chat", [], 50, None)
    # the domain's source field and schema are not the general data's; its file format is by suffix
    assert (replay.source_field, replay.json_schema, replay.format) == (None, None, "auto")
    assert (replay.packed_sequence_size, replay.split, replay.pii) == (256, cfg.data.split, "drop")
    assert cfg.data.source_field == "source" and cfg.data.replay is not None  # the run's own untouched
