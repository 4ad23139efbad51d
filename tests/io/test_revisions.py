"""glmtune.io.revisions: glmtune's code pin, and where a downloaded model's revision is read from."""

from __future__ import annotations

import shutil

import glmtune
from glmtune.io.revisions import SOURCE_ROOT, glmtune_pin, model_revision


def test_glmtune_pin_names_the_version_and_the_source():
    pin = glmtune_pin()
    assert pin["version"] == glmtune.__version__ and pin["source"] == str(SOURCE_ROOT)
    assert (SOURCE_ROOT / "glmtune" / "__init__.py").is_file()
    assert pin["commit"] is None or len(pin["commit"]) == 40


def test_revision_of_a_cache_snapshot_and_of_download_metadata(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = shutil.copytree(model, tmp_path / "models--zai-org--GLM-5" / "snapshots" / commit)
    assert model_revision(snapshot) == (commit, "HF cache snapshot directory")
    metadata = model / ".cache" / "huggingface" / "download" / "config.json.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text(f"{commit}\n{'b' * 40}\n1700000000.0\n")
    assert model_revision(model) == (commit, str(metadata))
    assert model_revision(tmp_path)[0] is None
