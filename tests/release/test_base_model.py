"""The base of a release from an HF directory: the revision its download recorded, or "local
directory"; and a base that is not the one the run trained on is refused."""

from __future__ import annotations

import shutil

import pytest

from glmtune.config import load_config
from glmtune.release.base_model import record_base

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _cfg(model_dir):
    return load_config("recipes/tiny/sft_support_json.yaml", [f"--model.name_or_path={model_dir}"])


def test_hf_base_revision_or_local_directory(saved, tmp_path):
    snapshot = tmp_path / "hub" / "models--zai-org--GLM-5" / "snapshots" / SNAPSHOT
    shutil.copytree(saved, snapshot)
    section, artifact = record_base(_cfg(snapshot), tmp_path / "run", {}, tmp_path, lora=False)
    assert (section["revision"], section["revision_source"]) == (SNAPSHOT, "HF cache snapshot directory")
    assert section["preset"] is None and section["artifact"] == "base" and artifact["kind"] == "dir"
    assert section["path"] == f"hub/models--zai-org--GLM-5/snapshots/{SNAPSHOT}"

    section, _ = record_base(_cfg(saved), tmp_path / "run", {}, tmp_path, lora=False)
    assert section["revision"] is None and section["revision_source"].startswith("local directory")
    assert section["weights_sha256"] and section["config_sha256"]


def test_base_changed_since_training_is_refused(saved, tmp_path):
    recorded = {"config_sha256": "ab" * 32, "weights_sha256": "cd" * 32}
    with pytest.raises(ValueError, match=r"is not the base the run trained on \(.*run.json\): config differs"):
        record_base(_cfg(saved), tmp_path / "run", {"base": recorded}, tmp_path, lora=True)
    with pytest.raises(ValueError, match="model.name_or_path .* is not a directory"):
        record_base(_cfg(tmp_path / "gone"), tmp_path / "run", {}, tmp_path, lora=True)


def test_preset_base_without_its_weights(tmp_path):
    """A run on a preset from before `train` wrote RUN_DIR/base: a full fine-tune records the preset;
    a LoRA adapter without its base is refused."""
    cfg = load_config("recipes/tiny/sft_support_json.yaml")
    section, artifact = record_base(cfg, tmp_path / "run", {}, tmp_path, lora=False)
    assert artifact is None and section["weights_sha256"] is None and section["config_sha256"]
    assert (section["preset"], section["seed"]) == ("tiny", 1234)
    assert "kept no copy of its initial weights" in section["revision_source"]
    with pytest.raises(ValueError, match="has no base/: a LoRA run on preset tiny keeps its base there"):
        record_base(cfg, tmp_path / "run", {}, tmp_path, lora=True)
