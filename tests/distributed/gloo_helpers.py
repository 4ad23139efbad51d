"""Run a function in N spawned CPU processes joined in one gloo process group.

The rendezvous is a file under the test's tmp_path (no port to collide with parallel
test runs). A worker that raises fails the test with its traceback; a run that outlives
its deadline (a rank stuck in a collective) is killed and fails the test.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    context = mp.start_processes(_entry, args=(fn, world_size, str(init_file), args), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world_size} gloo processes still running after {timeout_s:.0f} s")
