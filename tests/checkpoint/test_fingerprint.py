"""glmtune.checkpoint.fingerprint: a base's identity depends on its tensors and model config only (not on
sharding, file names or cosmetic config keys), and any weight or config change shows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME, checkpoint_files
from glmtune.checkpoint.fingerprint import identity_mismatch
from glmtune.models.registry import hf_dir_identity
from glmtune.models.glm5 import build_model, get_preset

KEY = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def model():
    return build_model(get_preset("tiny"), dtype=torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp") / "sharded"
    save_pretrained(model, path, max_shard_size="300KB")
    assert len(set(checkpoint_files(path).values())) >= 5
    return path


def test_identity_is_independent_of_sharding(model, sharded, tmp_path):
    single = save_pretrained(model, tmp_path / "single")
    assert not (single / INDEX_NAME).exists()
    a, b = hf_dir_identity(sharded), hf_dir_identity(single, num_threads=1)
    assert (a["kind"], a["path"]) == ("hf_dir", str(sharded.resolve()))
    for key in ("config_sha256", "weights_sha256", "num_tensors"):
        assert a[key] == b[key], key
    assert a["num_tensors"] == len(checkpoint_files(sharded))
    assert identity_mismatch(a, b) == []


def test_one_changed_weight_or_config_field_shows(sharded, tmp_path):
    recorded = hf_dir_identity(sharded)
    copy = shutil.copytree(sharded, tmp_path / "copy")
    file = checkpoint_files(copy)[KEY]
    tensors = load_file(file)
    tensors[KEY] = tensors[KEY].clone()
    tensors[KEY].view(-1)[0] += 1  # same shape and dtype, one value differs
    save_file(tensors, file, metadata={"format": "pt"})
    found = hf_dir_identity(copy)
    assert found["config_sha256"] == recorded["config_sha256"]
    assert identity_mismatch(recorded, found) == [
        f"weights differ: recorded sha256 {recorded['weights_sha256'][:12]}…, found {found['weights_sha256'][:12]}…"]

    config = json.loads((copy / "config.json").read_text())
    cosmetic = {**config, "transformers_version": "9.9.9", "_name_or_path": "/elsewhere", "use_cache": False}
    (copy / "config.json").write_text(json.dumps(cosmetic))
    assert hf_dir_identity(copy)["config_sha256"] == recorded["config_sha256"]
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    reasons = identity_mismatch(recorded, hf_dir_identity(copy))
    assert [r.split(":")[0] for r in reasons] == ["config differs", "weights differ"]


def test_a_truncated_shard_is_named(sharded, tmp_path):
    copy = shutil.copytree(sharded, tmp_path / "copy")
    file = checkpoint_files(copy)[KEY]
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"^{file}: truncated safetensors file"):
        hf_dir_identity(copy)
