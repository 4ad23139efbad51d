"""Hashing artifacts: the one-pass shard hashes and tensor identity of an HF directory equal
glmtune/checkpoint/fingerprint.py's; file-by-file drift of the three artifact kinds."""

from __future__ import annotations

import hashlib

from glmtune.models.registry import hf_dir_identity
from glmtune.release import artifacts
from glmtune.release.artifacts import check_artifact, record_artifact
from glmtune.release.base_model import record_hf_dir


def test_one_pass_identity_of_a_sharded_checkpoint(saved, tmp_path, monkeypatch):
    # Chunks of an odd size so tensors start and end inside chunks and span several of them.
    monkeypatch.setattr(artifacts, "_CHUNK_BYTES", 4099)
    artifact, identity = record_hf_dir("base", saved, "base model", tmp_path)
    expected = hf_dir_identity(saved)
    assert identity == {k: expected[k] for k in ("config_sha256", "weights_sha256", "num_tensors")}
    shards = [f for f in artifact["files"] if f["path"].endswith(".safetensors")]
    assert len(shards) > 3  # max_shard_size 1MB
    for entry in artifact["files"]:
        assert entry["sha256"] == hashlib.sha256((saved / entry["path"]).read_bytes()).hexdigest()
    assert artifact["root"] == str(saved)  # outside the manifest's directory: absolute


def test_artifact_kinds_and_drift(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "a.bin").write_bytes(b"a" * 100)
    (model / "sub" / "b.txt").write_text("b")
    (model / "tokenizer.json").write_text("{}")
    (model / ".cache").mkdir()
    (model / ".cache" / "meta").write_text("hidden: not part of the artifact")
    as_dir, _ = record_artifact("model", model, "dir", "a model", tmp_path)
    as_files, _ = record_artifact("tokenizer", model, "files", "its tokenizer", tmp_path, files=["tokenizer.json"])
    as_file, _ = record_artifact("weights", model / "a.bin", "file", "one file", tmp_path)
    assert [f["path"] for f in as_dir["files"]] == ["a.bin", "sub/b.txt", "tokenizer.json"]
    assert (as_dir["root"], as_files["root"], as_file["root"]) == ("model", "model", "model/a.bin")
    assert all(check_artifact(a, tmp_path) == ("ok", []) for a in (as_dir, as_files, as_file))

    (model / "new.txt").write_text("new")  # new files matter in a directory artifact only
    (model / "a.bin").write_bytes(b"a" * 99 + b"b")
    (model / "sub" / "b.txt").unlink()
    assert check_artifact(as_dir, tmp_path) == ("DRIFT", [
        "sub/b.txt is missing", f"a.bin sha256 changed ({as_dir['files'][0]['sha256'][:12]}… -> "
        f"{hashlib.sha256(b'a' * 99 + b'b').hexdigest()[:12]}…)", "new.txt is new (not recorded)"])
    assert check_artifact(as_files, tmp_path) == ("ok", [])
    assert check_artifact(as_file, tmp_path)[1][0].startswith("a.bin sha256 changed")
    (model / "a.bin").unlink()
    assert check_artifact(as_file, tmp_path) == ("DRIFT", [f"{model / 'a.bin'} is missing"])
