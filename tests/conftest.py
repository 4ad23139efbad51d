"""Shared fixtures: a sharded tiny HF checkpoint, and fresh copies of it a test may damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from glmtune.checkpoint.hf_io import save_pretrained
from glmtune.models.glm5 import build_model, get_preset


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_pretrained(build_model(get_preset("tiny"), seed=0), path, max_shard_size="1MB")
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of the sharded tiny checkpoint each test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "tiny"))
