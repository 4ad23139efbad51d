"""Several `glmtune train` runs of the tiny recipe in one set of forked processes, made once per session.

Each set runs on forked processes (tests/distributed/forked_cli.py: forked from the gloo fork
server with torch and glmtune imported, one process or N gloo ranks as torchrun starts them), every
run in turn through the CLI's own entry point (`glmtune.cli.main`, with the flags of
tests/train/run_helpers.py's `train_command`). A run's console output (stdout and stderr) goes to
`<name>.out` beside its run directory (rank 0's; the other ranks' to `<name>.rank<r>.out`).
Results are made once per test session through `shared_results` (xdist workers share them); read
them only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.distributed.forked_cli import commands_in_forks
from tests.train.run_helpers import SharedRun, train_command

RECIPE = "tiny/sft_support_json"


def train_in_forks(runs: dict[Path, list[str]], cache_dir: Path, nproc: int = 1, recipe: str = RECIPE) -> None:
    """Train each run directory of `runs` (in order) with its flags on `nproc` forked ranks."""
    commands_in_forks({run_dir: train_command(run_dir, cache_dir, *flags, recipe=recipe)[3:]
                       for run_dir, flags in runs.items()}, nproc)


def shared_train_runs(shared, runs: dict[str, list[str]], nproc: int = 1, recipe: str = RECIPE
                      ) -> dict[str, SharedRun]:
    """`runs` (name -> flags) trained once per session, in order, in one set of `nproc` forked
    processes sharing one data cache (the first run writes it); each name's SharedRun."""
    key = hashlib.sha256(json.dumps([recipe, nproc, list(runs.items())]).encode()).hexdigest()[:16]

    def build(root: Path) -> None:
        train_in_forks({root / name: flags for name, flags in runs.items()}, root / "cache", nproc, recipe)

    root = shared.get(f"forked-runs-{key}", build)
    return {name: SharedRun(root / name, root / "cache", (root / f"{name}.out").read_text()) for name in runs}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The test process computes on one torch thread, as the forked ranks and `glmtune train`
    subprocesses do: on a machine whose cores are all busy (CI: 2 workers on 2 cores) a second
    thread multiplies in-process tests' CPU time several times over. A test module that imports
    it runs every test so (both sides of each comparison alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
