"""Shared fixtures: a sharded tiny HF checkpoint, fresh copies of it a test may damage, and
results made once per session for several tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from glmtune import save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from tests.shared_results import SharedResults


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_pretrained(build_model(get_preset("tiny"), seed=0), path, max_shard_size="1MB")
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of the sharded tiny checkpoint each test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def shared_results(tmp_path_factory) -> SharedResults:
    """Results several tests read (reference runs, one gloo job for several cases), made once
    per session; under pytest-xdist the workers share them through the session's temp root."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # <session>/popen-gwN -> <session>, the same for every worker
    return SharedResults(root / "shared")
