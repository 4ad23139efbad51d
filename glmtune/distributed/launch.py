"""`glmtune train RECIPE --nproc-per-node N`: start the N processes of a one-host run with torchrun.

    glmtune train tiny/sft_support_json --nproc-per-node 2 --train.max_steps 20
    # is
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m glmtune train tiny/sft_support_json --train.max_steps 20

The other arguments reach every rank unchanged. Before a process starts, the recipe
is validated for a world of N (the same `validate_config` each rank runs), so a
layout that cannot run is one line and exit status 2, with nothing started or
written. Multi-host runs call torchrun (or srun + torchrun) themselves; `torchrun
... -m glmtune train RECIPE` works as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from glmtune.config import JobConfig, model_dims, validate_config
from glmtune.train.run_dir import STOP_FILE

# torchrun spells it both ways; so do we.
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def pop_nproc_per_node(tokens: list[str]) -> tuple[list[str], int | None]:
    """Take `--nproc-per-node N` or `--nproc-per-node=N` out of `tokens`: (the rest, N or None)."""
    rest: list[str] = []
    nproc: int | None = None
    index = 0
    while index < len(tokens):
        token = tokens[index]
        name, _, inline = token.partition("=")
        if name not in NPROC_FLAGS:
            rest.append(token)
            index += 1
            continue
        if inline:
            text, index = inline, index + 1
        elif index + 1 < len(tokens):
            text, index = tokens[index + 1], index + 2
        else:
            raise ValueError(f"{name} expects a number of processes")
        try:
            nproc = int(text)
        except ValueError:
            raise ValueError(f"{name} expects a number of processes, got {text!r}") from None
        if nproc < 1:
            raise ValueError(f"{name} must be >= 1, got {nproc}")
    return rest, nproc


def torchrun_command(nproc: int, train_args: list[str], debug: bool = False) -> list[str]:
    """The torchrun command line: a standalone rendezvous (a free local port) and N workers."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "glmtune", *(["--debug"] if debug else []), "train", *train_args]


def check_launch(cfg: JobConfig, nproc: int) -> None:
    """Refuse, before any process starts, what the N ranks would refuse anyway."""
    if "WORLD_SIZE" in os.environ:
        raise ValueError(f"--nproc-per-node: this process is already one of {os.environ['WORLD_SIZE']} started by "
                         "torchrun (WORLD_SIZE is set); drop --nproc-per-node")
    if cfg.parallel.launcher != "torchrun":
        raise ValueError(f"--nproc-per-node starts torchrun on this host, but parallel.launcher is "
                         f"{cfg.parallel.launcher}; set --parallel.launcher torchrun")
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=nproc)


def launch_torchrun(cfg: JobConfig, nproc: int, train_args: list[str], debug: bool = False) -> int:
    """Validate `cfg` for `nproc` ranks, run torchrun with `train_args` and return its exit status.

    torchrun runs in its own session: a Ctrl-C reaches this process only and is passed
    on once, as is SIGTERM or SIGHUP (a signal delivered twice would cut short torchrun's
    own shutdown, which gives each rank time to save a checkpoint). SIGUSR1 (a scheduler's
    warning before a time limit) is not passed on, torchrun has no handler for it: it
    creates the run's stop file, which every rank honours at the end of its step (no
    time limit on the save). The status is 130
    after such a signal (as `glmtune train`'s), else torchrun's: 0, or 1 when a rank
    failed (torchrun's report names the rank and that rank's own status).
    """
    check_launch(cfg, nproc)
    process: subprocess.Popen | None = None
    received: list[int] = []
    pending: list[int] = []  # received before torchrun existed

    def forward(signum: int, frame) -> None:
        received.append(signum)
        if signum == signal.SIGUSR1:  # torchrun would die of it: ask the ranks through the stop file
            stop_file = Path(cfg.logging.run_dir) / STOP_FILE
            if stop_file.parent.is_dir():
                stop_file.touch()
            return
        if process is None:
            pending.append(signum)
        else:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    try:
        process = subprocess.Popen(torchrun_command(nproc, train_args, debug), start_new_session=True)
        if pending:
            process.send_signal(pending[0])
        status = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # torchrun exits 1 after a forwarded signal; the ranks saved and stopped: "interrupted".
    return 130 if received and status != 0 else status
