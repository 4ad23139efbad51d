"""A continued-pretraining run's release (`data.kind: text`): its data section names the contract its
documents went through (glmtune/data/text_contract.py, by sha256), not the chat rows' one, and its
data files are the corpus' input list the run wrote (RUN_DIR/data/text_inputs.json)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import glmtune.data.contract as chat_contract
import glmtune.data.text_contract as text_contract
from glmtune.config import load_config
from glmtune.release.provenance import data_section


def _section(tmp_path: Path, recipe: str) -> dict:
    run_dir = tmp_path / "run"
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data_manifest.json").write_text(json.dumps({"kind": "text", "train_conversations": 3}))
    (run_dir / "data" / "text_inputs.json").write_text(json.dumps({"train": []}))
    section, _ = data_section(load_config(recipe, []), run_dir, {"train_conversations": 3}, run_dir, None)
    return section


def _sha256(module) -> str:
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


def test_a_text_runs_release_names_the_text_contract(tmp_path: Path) -> None:
    section = _section(tmp_path, "recipes/tiny/cpt_domain_text.yaml")
    assert section["contract"] == {"module": "glmtune/data/text_contract.py", "sha256": _sha256(text_contract)}
    assert section["files"]["names"] == ["text_inputs.json"]


def test_a_chat_runs_release_names_the_chat_contract(tmp_path: Path) -> None:
    section = _section(tmp_path, "recipes/tiny/sft_support_json.yaml")
    assert section["contract"] == {"module": "glmtune/data/contract.py", "sha256": _sha256(chat_contract)}
