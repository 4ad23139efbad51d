"""Finished runs to release: the shared SFT run with its HF export and the shared two-step LoRA
run (made once per session, also read by tests/distributed and tests/train), copied before a
test writes a release into them or damages their files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.release.eval_fixture import make_eval_dir
from tests.train.run_helpers import TWO_STEPS, WITH_EXPORT, shared_run


@pytest.fixture(scope="session")
def sft_source(shared_results) -> Path:
    return shared_run(shared_results, *WITH_EXPORT).run_dir  # also tests/distributed/test_hsdp.py's


@pytest.fixture(scope="session")
def lora_source(shared_results) -> Path:
    # also tests/train/test_run_e2e.py's and tests/peft/test_trained_adapter.py's
    return shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir


def copy_run(source: Path, dest: Path) -> Path:
    """The run without its checkpoints (a release does not read them)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("checkpoints"))
    return dest


@pytest.fixture
def sft_run(sft_source, tmp_path) -> tuple[Path, Path]:
    """(a copy of the SFT run, an eval directory that scored it)."""
    run = copy_run(sft_source, tmp_path / "sft")
    return run, make_eval_dir(tmp_path / "sft-eval", run)


@pytest.fixture
def lora_run(lora_source, tmp_path) -> tuple[Path, Path]:
    run = copy_run(lora_source, tmp_path / "lora")
    return run, make_eval_dir(tmp_path / "lora-eval", run)
