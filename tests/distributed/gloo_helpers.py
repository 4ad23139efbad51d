"""Run a function in N CPU processes joined in one gloo process group.

The processes are forked from this test process's multiprocessing fork server, which imports
torch, its distributed packages and the model once (the preload below); a spawned process
would spend seconds importing them again, for every rank of every run. The rendezvous is a
file under the test's tmp_path (no port to collide with parallel test runs). A worker that
raises fails the test with its traceback; a run that outlives its deadline (a rank stuck in a
collective) is killed and fails the test.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports before it forks any rank (a module it cannot import is skipped).
# The server starts once per test process with the first preload set: tests/distributed/test_mesh.py
# names the same modules, so whichever of its gloo runs and these comes first, both get them.
# glmtune.models.registry brings transformers and the HF model family (~1.3 s), glmtune.cli the
# command line: every forked `glmtune train` (tests/distributed/forked_cli.py) imported them itself.
# Not glmtune.train.run: its data modules import pyarrow, which starts a thread (jemalloc's), and
# the server forks; every module here leaves it with the threads torch started alone.
PRELOAD = ["tests.distributed.fork_server_env", "torch", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "glmtune.models.glm5", "glmtune.models.glm5.parallelize",
           "glmtune.checkpoint.hf_io", "glmtune.distributed.mesh", "glmtune.models.registry", "glmtune.cli",
           __name__]


def start_forkserver_ranks(fn, args: tuple, world_size: int, preload: list[str] = PRELOAD) -> mp.ProcessContext:
    """`fn(rank, *args)` on `world_size` processes forked from the (preloaded) fork server."""
    mp.set_forkserver_preload(preload)  # read when this process first starts its server
    return mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="forkserver")


def _entry(rank: int, fn, world_size: int, init_file: str, args: tuple) -> None:
    torch.set_num_threads(1)  # N processes share the test machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, tmp_path: Path, *args, timeout_s: float = 120.0) -> None:
    """Call `fn(rank, world_size, *args)` on ranks 0..world_size-1, each its own process.

    `fn` must be importable by name (a module-level function) and pass results back
    through files, e.g. under `tmp_path`.
    """
    init_file = tmp_path / f"gloo-rendezvous-{time.monotonic_ns()}"
    context = start_forkserver_ranks(_entry, (fn, world_size, str(init_file), args), world_size)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world_size} gloo processes still running after {timeout_s:.0f} s")
