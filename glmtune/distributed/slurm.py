"""The sbatch script of a multi-node run: `glmtune slurm` writes it, Slurm runs it.

Pure functions: `sbatch_script(SlurmJob(...))` is the script's text and needs no Slurm.
The script runs on the job's first node:

    #SBATCH --nodes N --ntasks-per-node=1 --gpus-per-node G --requeue --signal=B:USR1@LEAD ...
    srun: one task per node ->  python -m torch.distributed.run --nnodes $SLURM_NNODES
        --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:PORT --rdzv-id $SLURM_JOB_ID
        -m glmtune train RECIPE ... --checkpoint.resume auto

Stopping (docs/slurm.md). Slurm sends USR1 to the batch shell alone LEAD seconds before
the time limit. Its trap creates `<run_dir>/STOP_REQUESTED`: every rank sees the file at
the end of its step, the ranks agree, save one checkpoint, and rank 0 removes the file,
then they exit. Signalling the ranks instead would go through torchrun, whose SIGTERM
shutdown gives workers about 30 s, too short to save a large model. When srun has ended
and the file is gone, the stop was taken: the script runs `scontrol requeue` and the
requeued job resumes (`--checkpoint.resume auto`). SIGTERM (scancel, preemption, the hard
limit) asks for the same stop but is not requeued by the script: a job the user cancels
must stay cancelled, and Slurm requeues a preempted `--requeue` job itself.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from glmtune.config import JobConfig, validate_config
from glmtune.io.run_lock import STOP_FILE  # the name the trainer watches (in the run directory)

SCRIPT_DIR = "slurm"  # under the run directory: the scripts and the job logs
MAX_SIGNAL_LEAD = 65535  # sbatch --signal's limit, in seconds


@dataclass(frozen=True)
class SlurmJob:
    """What one sbatch script runs.

    Args:
        recipe: the recipe as `glmtune train` gets it (an absolute path: the job may start elsewhere).
        train_args: dotted overrides passed on to every rank unchanged.
        run_dir: `logging.run_dir`, absolute.
        workdir: the job's working directory (where `glmtune slurm` ran: relative paths keep working).
        nodes, gpus_per_node: the allocation; one torchrun per node, one rank per GPU.
        job_name, partition, time, account: sbatch's options of those names (None = the site's default).
        signal_lead: seconds before the time limit at which the batch shell gets USR1.
        rdzv_port: the c10d rendezvous port on the first node.
        python: the interpreter each node runs (this one: a virtual env on a shared filesystem).
    """

    recipe: str
    train_args: list[str]
    run_dir: Path
    workdir: Path
    nodes: int
    gpus_per_node: int
    job_name: str
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    signal_lead: int = 600
    rdzv_port: int = 29500
    python: str = field(default_factory=lambda: sys.executable)


# sbatch --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit (None for UNLIMITED); ValueError naming --time otherwise."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"--time {text!r} is not a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                         "D-HH:MM:SS)")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = first, second or 0, third or 0
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = first, second, third
    else:  # MM[:SS]
        hours, minutes, seconds = 0, first, second or 0
    return ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)


def check_job(job: SlurmJob) -> None:
    """Refuse flags sbatch or torchrun would refuse later, or that leave no time to save."""
    if not 1 <= job.signal_lead <= MAX_SIGNAL_LEAD:
        raise ValueError(f"--signal-lead must be between 1 and {MAX_SIGNAL_LEAD} seconds, got {job.signal_lead}")
    if not 1 <= job.rdzv_port <= 65535:
        raise ValueError(f"--rdzv-port must be a TCP port (1-65535), got {job.rdzv_port}")
    if job.time is not None:
        limit = time_limit_seconds(job.time)
        if limit is not None and job.signal_lead >= limit:
            raise ValueError(f"--signal-lead {job.signal_lead} s is not shorter than --time {job.time} ({limit} s): "
                             "the stop request would come before the job starts")
    for flag, value in (("--job-name", job.job_name), ("--partition", job.partition), ("--account", job.account)):
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError(f"{flag} {value!r}: sbatch takes a name without spaces")


def check_slurm_launch(cfg: JobConfig, nodes: int, gpus_per_node: int | None, dims) -> int:
    """Validate `cfg` for nodes x gpus_per_node ranks, as every rank will; the GPUs per node.
    `dims`: the model's routed experts and decoder layers (the family's `model_dims`).

    The recipe's `parallel.nodes` / `parallel.gpus_per_node`, when set, must be the flags'
    (`--gpus-per-node` defaults to the recipe's). `cfg.parallel` is set to the job's layout."""
    p = cfg.parallel
    if p.nodes is not None and p.nodes != nodes:
        raise ValueError(f"--nodes {nodes} disagrees with parallel.nodes ({p.nodes}) in the recipe; pass --nodes "
                         f"{p.nodes}, or change the recipe with --parallel.nodes {nodes}")
    if gpus_per_node is None:
        if p.gpus_per_node is None:
            raise ValueError("--gpus-per-node is needed: the recipe sets no parallel.gpus_per_node")
        gpus_per_node = p.gpus_per_node
    elif p.gpus_per_node is not None and p.gpus_per_node != gpus_per_node:
        raise ValueError(f"--gpus-per-node {gpus_per_node} disagrees with parallel.gpus_per_node ({p.gpus_per_node}) "
                         f"in the recipe; pass --gpus-per-node {p.gpus_per_node}, or change the recipe with "
                         f"--parallel.gpus_per_node {gpus_per_node}")
    p.nodes, p.gpus_per_node, p.launcher = nodes, gpus_per_node, "slurm"
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=nodes * gpus_per_node,
                    model_refusals=dims.refusals)
    return gpus_per_node


def train_args(job: SlurmJob) -> list[str]:
    """`glmtune train`'s arguments on every rank: the user's, then the job's layout and resume.

    Last, so they win: each rank checks its WORLD_SIZE against nodes x gpus_per_node, and a
    requeued job continues from its latest checkpoint."""
    return [job.recipe, *job.train_args, "--parallel.launcher", "slurm", "--parallel.nodes", str(job.nodes),
            "--parallel.gpus_per_node", str(job.gpus_per_node), "--checkpoint.resume", "auto"]


def _sbatch_lines(job: SlurmJob) -> list[str]:
    logs = job.run_dir / SCRIPT_DIR
    options = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
               f"--gpus-per-node={job.gpus_per_node}",
               "--exclusive",  # the node's CPUs and memory go with its GPUs
               "--mem=0"]
    options += [f"--{name}={value}" for name, value in
                (("partition", job.partition), ("time", job.time), ("account", job.account)) if value is not None]
    options += ["--requeue", f"--signal=B:USR1@{job.signal_lead}",
                "--open-mode=append",  # a requeued job (same job id) appends to its logs
                f"--output={logs}/%x-%j.out", f"--error={logs}/%x-%j.err"]
    return [f"#SBATCH {option}" for option in options]


def sbatch_script(job: SlurmJob) -> str:
    """The complete batch script of `job` (bash; `sbatch FILE` submits it)."""
    sections = [_script_header(job), _shell_setup(job), _stop_trap(job), _launch(job), _wait_and_decide()]
    return "\n".join(sections)  # each section ends in a newline: a blank line between sections


def _script_header(job: SlurmJob) -> str:
    """The shebang, what the script runs and where it logs, and its #SBATCH options."""
    world = job.nodes * job.gpus_per_node
    return f"""#!/bin/bash
# Written by `glmtune slurm`: run '{job.job_name}' on {job.nodes} nodes x {job.gpus_per_node} GPUs (world {world}).
# Submit with `sbatch FILE`. The logs go to {job.run_dir / SCRIPT_DIR}/, which must exist when
# the job starts (glmtune slurm creates it; after --dry-run, mkdir -p it).
{chr(10).join(_sbatch_lines(job))}
"""


def _shell_setup(job: SlurmJob) -> str:
    """The shell's options and paths, NCCL's environment, and the rendezvous host and port."""
    q = shlex.quote
    return f"""# Not `set -e`: how the training ended decides what happens next.
set -u
cd {q(str(job.workdir))}
RUN_DIR={q(str(job.run_dir))}
STOP_FILE="$RUN_DIR/{STOP_FILE}"

# NCCL: a rank whose collective fails or times out (a peer died) aborts its communicator and
# exits instead of hanging until the time limit; srun --kill-on-bad-exit then ends the others.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_ASYNC_ERROR_HANDLING=1  # the same, its name before PyTorch 2.2
# Blocking wait makes every collective synchronous on the host: slower, and not needed with the above.
export TORCH_NCCL_BLOCKING_WAIT=0
export NCCL_DEBUG=WARN  # errors and warnings in the log; INFO writes pages per rank
export PYTHONUNBUFFERED=1  # the per-step lines reach the log when they are printed

# One c10d rendezvous, hosted by the first node's torchrun; its id is the job's, so a
# requeued job (same id, new allocation) meets afresh.
MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RDZV_PORT={job.rdzv_port}
echo "glmtune slurm: job $SLURM_JOB_ID, $SLURM_NNODES nodes x {job.gpus_per_node} GPUs, rendezvous $MASTER_HOST:$RDZV_PORT"
"""


def _stop_trap(job: SlurmJob) -> str:
    """The USR1 and TERM traps: they ask the training to stop through the stop file."""
    return f"""# USR1 (the time limit is {job.signal_lead} s away) or TERM: ask every rank to save and stop
# through the stop file, not a signal (torchrun gives its workers ~30 s after SIGTERM).
# Only a USR1 stop is requeued: TERM also comes from scancel, and a preempted job is
# requeued by Slurm itself.
STOP_SIGNAL=""
REQUEUE=0
CAUGHT=0
request_stop() {{
    CAUGHT=1
    if [ "$1" = USR1 ] && [ -z "$STOP_SIGNAL" ]; then REQUEUE=1; fi
    if [ "$1" = TERM ]; then REQUEUE=0; fi
    if [ -z "$STOP_SIGNAL" ]; then
        STOP_SIGNAL=$1
        echo "glmtune slurm: SIG$1: asking the training to save a checkpoint and stop ($STOP_FILE)"
        touch "$STOP_FILE"
    fi
}}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM
"""


def _launch(job: SlurmJob) -> str:
    """srun starting one torchrun per node, in the background, and its pid."""
    return f"""# srun in the background: bash runs a trap only between commands, and `wait` is one it interrupts.
# --cpus-per-task: a node's one task gets the node's CPUs, not the default one CPU that
# binding would put torchrun and all its ranks on.
{_torchrun_command(job)}
SRUN_PID=$!
"""


def _torchrun_command(job: SlurmJob) -> str:
    """The srun + torchrun command line, continued over lines: one train override per line."""
    q = shlex.quote
    args = train_args(job)
    lines = [
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=\"$SLURM_CPUS_ON_NODE\" {q(job.python)} "
        "-m torch.distributed.run",
        f"--nnodes \"$SLURM_NNODES\" --nproc-per-node {job.gpus_per_node}",
        "--rdzv-backend c10d --rdzv-endpoint \"$MASTER_HOST:$RDZV_PORT\" --rdzv-id \"$SLURM_JOB_ID\"",
        f"-m glmtune train {q(args[0])}",
    ]
    for token in args[1:]:  # one override (`--key value`) per line
        if token.startswith("--"):
            lines.append(q(token))
        else:
            lines[-1] += f" {q(token)}"
    return " \\\n    ".join(lines) + " &"


def _wait_and_decide() -> str:
    """Waiting for srun through the traps, then requeueing, reporting or exiting with its status."""
    return """# A trap ends `wait` early (status > 128) while srun runs on: wait again until srun has ended.
# After a signal that lands just as srun ends there is nothing left to wait for (127): keep
# the status before.
STATUS=""
while :; do
    CAUGHT=0
    wait "$SRUN_PID"
    RC=$?
    if [ "$RC" -eq 127 ] && [ -n "$STATUS" ]; then break; fi
    STATUS=$RC
    if [ "$CAUGHT" = 0 ]; then break; fi
done
trap '' USR1 TERM  # decided from here on (a requeue signals this shell too)

if [ -n "$STOP_SIGNAL" ] && [ ! -e "$STOP_FILE" ]; then
    # The trainer removes the file once the checkpoint is complete: the stop was taken.
    if [ "$REQUEUE" = 1 ]; then
        echo "glmtune slurm: the training saved a checkpoint and stopped; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || echo "glmtune slurm: scontrol requeue failed; submit this script" \\
            "again to continue from the checkpoint" >&2
    else
        echo "glmtune slurm: the training saved a checkpoint and stopped (SIG$STOP_SIGNAL: not requeued)"
    fi
    exit 130
fi
if [ -n "$STOP_SIGNAL" ]; then
    rm -f "$STOP_FILE"  # not taken: the training had ended; a later run must not stop at its first step
    echo "glmtune slurm: the training ended (status $STATUS) before it took the stop request"
fi
exit "$STATUS"
"""


def write_script(run_dir: Path, text: str, stamp: str | None = None) -> Path:
    """Write `text` to <run_dir>/slurm/<stamp>-sbatch.sh, atomically, never over an existing file.

    A hard link publishes the complete file under its name and fails if the name is taken;
    the next free name (`<stamp>-2-sbatch.sh`, ...) is used then."""
    folder = Path(run_dir) / SCRIPT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    tmp = folder / f".{stamp}-{os.getpid()}-sbatch.sh.tmp"
    with open(tmp, "x", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        number = 1
        while True:
            final = folder / (f"{stamp}-sbatch.sh" if number == 1 else f"{stamp}-{number}-sbatch.sh")
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                number += 1
    finally:
        tmp.unlink()
