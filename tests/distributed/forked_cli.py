"""`glmtune` argvs (`train`, and `eval` or `decide`) run through the CLI's entry point in processes forked
from the gloo fork server.

`python -m glmtune train` (and torchrun) spend seconds of every run importing torch, glmtune and the
CLI's subcommands; the tests' runs train for a few seconds only. Here the processes are forked from
the gloo fork server (tests/distributed/gloo_helpers.py: torch and glmtune already imported) and each
runs every argv of a set in turn through `glmtune.cli.main`:

- `nproc=1`: one process and no process group, as a plain `glmtune train` (or `eval`) is;
- `nproc=N`: N ranks joined in one gloo group with WORLD_SIZE, RANK and LOCAL_RANK set, as torchrun
  starts them; each run finds the group joined, uses it and leaves it for the next run, once what
  the run left in reference cycles is freed on every rank (`_end_of_run`).

A run's console output (at the file-descriptor level, Python's and native writes alike, as the
subprocess helpers capture it) goes to `<name>.out` beside its run directory: rank 0's, which prints
the run's log; the other ranks' to `<name>.rank<r>.out`. Stdout and stderr go there together, or with
`stderr_apart` stderr to `<name>.err` (`<name>.rank<r>.err`), as `subprocess.run` keeps them. The
processes run in the test process's working directory and environment (a subprocess's; the fork
server's are those of the moment it started). A run that exits non-zero, or a rank that raises, fails
the set with its output, unless the set is run unchecked (`check=False`: each run's exit status is
written beside its output, as `python -m glmtune` would end with it); a set that outlives its deadline
(a rank stuck in a collective) is killed.

tests/distributed/forked_runs.py trains sets of layouts this way; tests/train/run_helpers.py's
`shared_run` builds its once-per-session references this way, and its `run` runs the runs that may be
refused (this module does not import it).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glmtune.cli import main
from tests.distributed.gloo_helpers import start_forkserver_ranks

SECONDS_PER_RUN = 180.0  # a generous deadline: a few seconds each on an idle machine


@contextmanager
def _output_to(path: str, err_path: str | None = None):
    """File descriptors 1 and 2 (Python's and native writes alike) into `path` (2 into `err_path` if given)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as out, (open(err_path, "w") if err_path else nullcontext(out)) as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _outputs(out: str, rank: int, stderr_apart: bool) -> tuple[str, str | None]:
    """This rank's stdout file (stderr too unless `stderr_apart`) and its stderr file or None."""
    stem = out.removesuffix(".out") if rank == 0 else f"{out.removesuffix('.out')}.rank{rank}"
    return f"{stem}.out", (f"{stem}.err" if stderr_apart else None)


def _entry(rank: int, world_size: int, init_file: str, jobs: list[tuple[str, list[str]]],
           stderr_apart: bool = False, where: tuple[str, dict[str, str]] | None = None, check: bool = True) -> None:
    torch.set_num_threads(1)  # as run_helpers.env's OMP_NUM_THREADS=1 (and the ranks share the cores)
    # A rank that dies by a signal (a native abort) writes every thread's Python stack to file
    # descriptor 2, the running job's output, as `glmtune`'s entry point does (cli.run).
    faulthandler.enable(all_threads=True)
    if where is not None:  # the test process's working directory and environment, as a subprocess has them
        os.chdir(where[0])
        os.environ.clear()
        os.environ.update(where[1])
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if world_size > 1:
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for out, argv in jobs:
            output, errors = _outputs(out, rank, stderr_apart)
            if check:
                _run_checked(argv, rank, output, errors)
            else:
                Path(output).with_suffix(".rc").write_text(f"{_exit_status(argv, output, errors)}\n")
            _end_of_run(world_size)
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _run_checked(argv: list[str], rank: int, output: str, errors: str | None) -> None:
    """One run that must exit 0: anything else raises with the run's log, not only the traceback."""
    try:
        with _output_to(output, errors):
            code = main(argv)
    except BaseException as exc:
        raise RuntimeError(f"rank {rank}: glmtune {' '.join(argv[:2])} raised ({output}):\n"
                           + _log(output, errors)) from exc
    if code != 0:
        raise RuntimeError(f"rank {rank}: glmtune {' '.join(argv[:2])} exited {code} ({output}):\n"
                           + _log(output, errors))


def _exit_status(argv: list[str], output: str, errors: str | None) -> int:
    """One run's exit status as `python -m glmtune` would end with it: main's code; a SystemExit's
    (argparse's usage errors); 1 with the traceback on stderr for an exception that escaped main."""
    with _output_to(output, errors):
        try:
            return main(argv)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            traceback.print_exc()
            return 1


def _end_of_run(world_size: int) -> None:
    """What a run left in reference cycles (a sharded model's modules, hooks and tensors: thousands of
    objects) is freed now, on every rank before any starts the next run, as the CLI's entry point
    frees it when its command ends (cli.run): not at whatever point of the next run the collector
    comes round to it, with that run's collectives in flight. (The run's process groups stay
    registered with torch.distributed until the set's `destroy_process_group`.)"""
    gc.collect()
    if world_size > 1:
        dist.barrier()


def _log(output: str, errors: str | None) -> str:
    text = Path(output).read_text()[-6000:]
    return text + ("\n" + Path(errors).read_text()[-6000:] if errors else "")


def commands_in_forks(runs: dict[Path, list[str]], nproc: int = 1, stderr_apart: bool = False,
                      seconds_per_run: float = SECONDS_PER_RUN, check: bool = True) -> None:
    """Each run directory's whole `glmtune` argv (in order; it names its own run directory, data cache and
    flags; an `eval` its output directory) on `nproc` forked ranks, the output beside it in `<run_dir>.out`
    (and `.err`).
    With `check` off a run may end as it will: each rank's exit status is written to `<name>.rc` (as
    its `.out`'s stem) and the set goes on."""
    jobs = [(str(run_dir.parent / f"{run_dir.name}.out"), argv) for run_dir, argv in runs.items()]
    assert all(argv[0] in ("train", "eval", "decide") for _, argv in jobs)
    init_file = next(iter(runs)).parent / f"gloo-rendezvous-{time.monotonic_ns()}"
    where = (os.getcwd(), dict(os.environ))  # the fork server's are those of the moment it started
    context = start_forkserver_ranks(_entry, (nproc, str(init_file), jobs, stderr_apart, where, check), nproc)
    deadline = time.monotonic() + seconds_per_run * len(jobs)
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{len(jobs)} runs on {nproc} forked processes not done after "
                                   f"{seconds_per_run * len(jobs):.0f} s")
    except mp.ProcessExitedException as exc:  # a rank died without a Python exception (a signal): the outputs tell
        raise RuntimeError(f"{exc}; the runs' outputs:\n{_outputs_so_far(jobs, nproc, stderr_apart)}") from exc


def ended(run_dir: Path) -> tuple[int, str, str]:
    """An unchecked one-process run's exit status, stdout and stderr (`<run_dir>.rc`, `.out`, `.err`: a set
    run with `stderr_apart=True, check=False`)."""
    code, out, err = ((run_dir.parent / f"{run_dir.name}.{suffix}").read_text() for suffix in ("rc", "out", "err"))
    return int(code), out, err


def _outputs_so_far(jobs: list[tuple[str, list[str]]], nproc: int, stderr_apart: bool) -> str:
    """The tail of every output a rank has begun (a signal's faulthandler stacks end one of them)."""
    begun = [_outputs(out, rank, stderr_apart) for out, _ in jobs for rank in range(nproc)]
    return "\n".join(f"--- {output}\n{_log(output, errors)}" for output, errors in begun if Path(output).exists())
