"""Several `glmtune train` runs of the tiny recipe in one set of forked processes, made once per session.

`python -m glmtune train` (and torchrun) spend seconds of every run importing torch, glmtune and the
CLI's subcommands; the layout tests train for a few seconds only. Here the processes are forked from
the gloo fork server (tests/distributed/gloo_helpers.py: torch and glmtune already imported) and each
runs every run of a set in turn through the CLI's own entry point (`glmtune.cli.main`, with the
flags of tests/train/run_helpers.py's `train_command`):

- `nproc=1`: one process and no process group, as a plain `glmtune train` is;
- `nproc=N`: N ranks joined in one gloo group with WORLD_SIZE, RANK and LOCAL_RANK set, as torchrun
  starts them; each run finds the group joined, uses it and leaves it for the next run.

A run's console output (stdout and stderr, at the file-descriptor level, as the subprocess helpers
capture it) goes to `<name>.out` beside its run directory: rank 0's, which prints the run's log;
the other ranks' to `<name>.rank<r>.out`. A run that exits non-zero, or a rank that raises, fails the
set with its output; a set that outlives its deadline (a rank stuck in a collective) is killed.
Results are made once per test session through `shared_results` (xdist workers share them); read
them only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.gloo_helpers import start_forkserver_ranks
from tests.train.run_helpers import SharedRun, train_command

RECIPE = "tiny/sft_support_json"
SECONDS_PER_RUN = 180.0  # a generous deadline: a few seconds each on an idle machine


@contextmanager
def _output_to(path: str):
    """File descriptors 1 and 2 (Python's and native writes alike) into `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _entry(rank: int, world_size: int, init_file: str, jobs: list[tuple[str, list[str]]]) -> None:
    torch.set_num_threads(1)  # as run_helpers.env's OMP_NUM_THREADS=1 (and the ranks share the cores)
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if world_size > 1:
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from glmtune.cli import main

    try:
        for out, argv in jobs:
            output = out if rank == 0 else f"{out.removesuffix('.out')}.rank{rank}.out"
            try:
                with _output_to(output):
                    code = main(argv)
            except BaseException as exc:  # with the run's log, not only the traceback
                raise RuntimeError(f"rank {rank}: glmtune {' '.join(argv[:2])} raised ({output}):\n"
                                   + Path(output).read_text()[-6000:]) from exc
            if code != 0:
                raise RuntimeError(f"rank {rank}: glmtune {' '.join(argv[:2])} exited {code} ({output}):\n"
                                   + Path(output).read_text()[-6000:])
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train_in_forks(runs: dict[Path, list[str]], cache_dir: Path, nproc: int = 1, recipe: str = RECIPE) -> None:
    """Train each run directory of `runs` (in order) with its flags on `nproc` forked ranks."""
    commands_in_forks({run_dir: train_command(run_dir, cache_dir, *flags, recipe=recipe)[3:]
                       for run_dir, flags in runs.items()}, nproc)


def commands_in_forks(runs: dict[Path, list[str]], nproc: int = 1) -> None:
    """Each run directory's whole `glmtune train` argv (in order; it names its own run directory, data
    cache and flags) on `nproc` forked ranks, the output beside it in `<run_dir>.out`."""
    jobs = [(str(run_dir.parent / f"{run_dir.name}.out"), argv) for run_dir, argv in runs.items()]
    assert all(argv[0] == "train" for _, argv in jobs)
    init_file = next(iter(runs)).parent / f"gloo-rendezvous-{time.monotonic_ns()}"
    context = start_forkserver_ranks(_entry, (nproc, str(init_file), jobs), nproc)
    deadline = time.monotonic() + SECONDS_PER_RUN * len(jobs)
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{len(jobs)} runs on {nproc} forked processes not done after "
                               f"{SECONDS_PER_RUN * len(jobs):.0f} s")


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
