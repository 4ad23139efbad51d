"""Shared preflight runs: each tiny recipe's whole `glmtune preflight` once per session.

The end-to-end tests read their reports; the fault tests reuse their reference runs (the
uninterrupted runs every later check compares against) and plant their faults in fresh
directories, so that each fault costs only the check it breaks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.config.loader import RECIPES_DIR
from glmtune.preflight.context import Preflight
from glmtune.preflight.runs import ReferenceRun, read_records

SFT = RECIPES_DIR / "tiny" / "sft_support_json.yaml"
LORA = RECIPES_DIR / "tiny" / "lora_support_json.yaml"


@dataclass
class Done:
    """A finished preflight: its directory, exit status and report."""

    out: Path
    status: int
    report: dict

    def check(self, number: int) -> dict:
        return self.report["checks"][number - 1]

    def reference(self) -> ReferenceRun:
        """Its reference run, read back from disk (records, run directory)."""
        run_dir = self.out / "work" / "reference"
        return ReferenceRun(run_dir, self.out / "work" / "reference.log", status=0, records=read_records(run_dir))


def _preflight(shared, name: str, recipe: Path) -> Done:
    """`glmtune preflight` of `recipe` once per test session, whichever xdist worker asks first
    (`shared_results`): the others read its directory, exit status and report."""
    def build(root: Path) -> None:
        status = main(["preflight", str(recipe), "--out", str(root / "out")])
        (root / "status").write_text(str(status))

    root = shared.get(f"preflight-{name}", build)
    out = root / "out"
    report = json.loads((out / "preflight.json").read_text()) if (out / "preflight.json").is_file() else {}
    return Done(out, int((root / "status").read_text()), report)


@pytest.fixture(scope="session")
def sft_done(shared_results) -> Done:
    return _preflight(shared_results, "sft", SFT)


@pytest.fixture(scope="session")
def lora_done(shared_results) -> Done:
    return _preflight(shared_results, "lora", LORA)


@pytest.fixture
def fresh(tmp_path):
    """A Preflight of a recipe in an empty directory of this test."""
    def make(recipe: Path = SFT, *overrides: str, **options) -> Preflight:
        return Preflight(recipe, list(overrides), tmp_path / "out", **options)
    return make
