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

torchrun runs as `python -m glmtune.distributed.launch ...` (`torchrun_main`): torchrun
itself, except that a stop signal ends it with an exit status instead of its
`SignalException` traceback (the ranks stopped by then: by torchrun, or by
`stop_unrecorded_ranks` those a signal kept it from recording), and a failed rank with
torchrun's report alone. This module imports nothing heavy at the top, so that process
reaches `torchrun_main` before a signal can find it in an import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from glmtune.config import JobConfig, validate_config
from glmtune.io.interrupts import interrupts_deferred
from glmtune.io.run_lock import STOP_FILE  # the name the trainer watches (in the run directory)

# torchrun's own wait before it kills a rank that ignores the stop signal (its shutdown_timeout).
RANK_GRACE_S = 30.0
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


def torchrun_command(nproc: int, train_args: list[str], debug: bool = False, command: str = "train") -> list[str]:
    """The torchrun command line: a standalone rendezvous (a free local port) and N workers, each
    running `glmtune COMMAND ARGS`."""
    return [sys.executable, "-m", "glmtune.distributed.launch", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "glmtune", *(["--debug"] if debug else []), command, *train_args]


def refuse_nested_launch() -> None:
    """--nproc-per-node inside a process torchrun started would start N x N ranks."""
    if "WORLD_SIZE" in os.environ:
        raise ValueError(f"--nproc-per-node: this process is already one of {os.environ['WORLD_SIZE']} started by "
                         "torchrun (WORLD_SIZE is set); drop --nproc-per-node")


def run_command_on_ranks(nproc: int, command: str, args: list[str], debug: bool = False) -> int:
    """`glmtune COMMAND ARGS` on `nproc` ranks of this host (a command without a run directory or
    checkpoints to save: `glmtune eval`); torchrun's exit status. A Ctrl-C or SIGTERM is passed
    on to torchrun once, which stops the ranks; 130 then."""
    refuse_nested_launch()
    process = _start_with_sigint_blocked(torchrun_command(nproc, args, debug, command))
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        if not received:
            process.send_signal(signum)
        received.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        status = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 130 if received and status != 0 else status


def check_launch(cfg: JobConfig, nproc: int, dims) -> None:
    """Refuse, before any process starts, what the N ranks would refuse anyway. `dims`: the
    model's routed experts and decoder layers (`num_experts`, `num_layers`; the model
    family's `model_dims`: distributed/ knows no model)."""
    refuse_nested_launch()
    if cfg.parallel.launcher != "torchrun":
        raise ValueError(f"--nproc-per-node starts torchrun on this host, but parallel.launcher is "
                         f"{cfg.parallel.launcher}; set --parallel.launcher torchrun")
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=nproc, model_refusals=dims.refusals)


def launch_torchrun(cfg: JobConfig, nproc: int, train_args: list[str], dims, debug: bool = False) -> int:
    """Validate `cfg` for `nproc` ranks (`dims` as `check_launch`), run torchrun with
    `train_args` and return its exit status.

    torchrun runs in its own session: a Ctrl-C reaches this process only and is passed
    on once, as is SIGTERM or SIGHUP; later ones are not (a second signal would cut short
    torchrun's own shutdown, which gives each rank time to save a checkpoint, and could
    leave ranks behind). SIGUSR1 (a scheduler's warning before a time limit) is not passed
    on, torchrun has no handler for it: it creates the run's stop file, which every rank
    honours at the end of its step (no time limit on the save). After such a signal the
    launcher waits for torchrun (which waits for the ranks), says "interrupted" once and
    returns 130 (as `glmtune train`); otherwise torchrun's status: 0, or 1 when a rank
    failed (torchrun's report names the rank and that rank's own status).
    """
    check_launch(cfg, nproc, dims)
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
        if sum(sig != signal.SIGUSR1 for sig in received) > 1:  # one passed on already (see above)
            return
        if process is None:
            pending.append(signum)
        else:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    try:
        process = _start_with_sigint_blocked(torchrun_command(nproc, train_args, debug))
        if pending:
            process.send_signal(pending[0])
        status = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not received or status == 0:
        return status
    # The ranks saved (or had nothing to save) and stopped; torchrun reaped them before exiting.
    names = ", ".join(dict.fromkeys(signal.Signals(sig).name for sig in received))
    print(f"glmtune train: interrupted ({names}); torchrun and its {nproc} ranks have stopped", file=sys.stderr)
    return 130


def _start_with_sigint_blocked(command: list[str]) -> subprocess.Popen:
    """Start `command` in its own session with SIGINT blocked, as the signal mask is inherited.

    A Ctrl-C then waits in the new process until `glmtune.io.interrupts.interrupts_deferred` lets it
    in, instead of interrupting the interpreter's start-up with a traceback. Here the
    signal waits only until Popen returns; `forward` then passes it on.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen(command, start_new_session=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def torchrun_main(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`) with `argv`, its exit status without its tracebacks.

    torchrun turns SIGINT/SIGTERM/SIGHUP into `SignalException` once it starts the ranks,
    sends the signal on to them, waits (SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s)
    and only then re-raises: 128 + the signal here. A signal before that finds no rank
    started: 130. A failed rank is torchrun's report (which rank, its status), status 1.
    """
    try:
        with interrupts_deferred():  # importing torch: see interrupts_deferred
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            from torch.distributed.run import main
    except KeyboardInterrupt:
        return 130
    # torchrun starts the ranks from this thread, and they inherit its signal mask: with SIGINT
    # blocked, one passed on to a rank still starting waits there for interrupts_deferred (see
    # _start_with_sigint_blocked). This process takes it through a thread that leaves it unblocked.
    threading.Thread(target=threading.Event().wait, name="glmtune-sigint", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        main(argv)
    except SignalException as exc:
        stop_unrecorded_ranks(int(exc.sigval))
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # before torchrun installed its handlers, so before any rank started
        return 130
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


def stop_unrecorded_ranks(signum: int, grace_s: float = RANK_GRACE_S) -> None:
    """Stop the ranks that torchrun started but does not know of, as torchrun stops the others.

    torchrun stops only the ranks it has recorded. A signal that lands while it starts them
    (after their Popen, before it keeps their handles) raises in the middle of that, and its
    shutdown finds none: the ranks run on, in sessions of their own, with the terminal's
    output. They are still this process's children: `signum` to each one's process group,
    SIGKILL to those left after `grace_s`. Without /proc (not Linux) there is nothing to list.
    """
    left = _live_children()
    for pid in left:
        _signal_group(pid, signum)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {pid for pid in left if not _reaped(pid)}
    for pid in left:
        _signal_group(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _live_children() -> set[int]:
    """This process's children not yet reaped (ppid is the 4th field of /proc/PID/stat)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == os.getpid():
            children.add(int(stat.parent.name))
    return children


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # its session's group: what it started too
    except ProcessLookupError:  # forked but not yet in its own session: the process alone
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped elsewhere
        return True


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
