"""Launch small `glmtune train` runs of the tiny recipe as subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from tests.distributed.forked_cli import commands_in_forks, ended

SMALL = [
    "--train.max_steps", "8", "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0",
    "--data.synthetic.rows", "240", "--data.packed_sequence_size", "256",
    "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.val_every", "0",
    "--train.generate_samples", "0", "--checkpoint.export_hf", "false", "--logging.progress", "false",
    "--logging.tensorboard", "false", "--train.log_every", "1", "--optim.warmup_steps", "2",
]


# Four steps with a checkpoint after step 2, the flags of the one-process references that tests
# in several files compare against (each such reference is one `shared_run`).
FOUR_STEPS = ["--train.max_steps", "4", "--checkpoint.every_steps", "2"]
WITH_VALIDATION = [*FOUR_STEPS, "--train.val_every", "2"]  # validation losses at steps 2 and 4
WITH_EXPORT = [*FOUR_STEPS, "--checkpoint.export_hf", "true"]  # global batch 4, the HF export
BATCH_8_WITH_EXPORT = [*WITH_EXPORT, "--train.global_batch_size", "8"]  # as 4 ranks x micro-batch 2
TWO_STEPS = ["--train.max_steps", "2", "--checkpoint.every_steps", "2"]  # the shortest finished run


def train_command(run_dir: Path, cache_dir: Path, *extra: str, recipe: str = "tiny/sft_support_json") -> list[str]:
    return [sys.executable, "-m", "glmtune", "train", recipe, *SMALL,
            "--logging.run_dir", str(run_dir), "--data.cache_dir", str(cache_dir), *extra]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run(run_dir: Path, cache_dir: Path, *extra: str, recipe: str = "tiny/sft_support_json"
        ) -> subprocess.CompletedProcess:
    """A `glmtune train` run that may end as it will (a refusal, a failure), in a process forked from the
    gloo fork server (`command_in_fork`'s way, not seconds of imports in a fresh interpreter): its exit
    status as `python -m glmtune` ends with it, stdout and stderr apart. What it printed is kept outside
    the run's directory and its parent (tests compare those trees before and after)."""
    argv = train_command(run_dir, cache_dir, *extra, recipe=recipe)
    with tempfile.TemporaryDirectory(prefix="glmtune-run-") as outputs:
        named = Path(outputs) / "run"
        commands_in_forks({named: argv[3:]}, stderr_apart=True, seconds_per_run=600.0, check=False)
        code, out, err = ended(named)
    return subprocess.CompletedProcess(argv, code, out, err)


def run_in_fork(run_dir: Path, cache_dir: Path, *extra: str, recipe: str = "tiny/sft_support_json"
                ) -> subprocess.CompletedProcess:
    """`run` of a run that must finish, in a forked process (`command_in_fork`)."""
    return command_in_fork(train_command(run_dir, cache_dir, *extra, recipe=recipe), run_dir)


def command_in_fork(argv: list[str], run_dir: Path, nproc: int = 1) -> subprocess.CompletedProcess:
    """A `glmtune train` command (`train_command`'s form: python -m glmtune train ...) of a run that must
    finish, through the CLI's entry point on `nproc` processes forked from the gloo fork server
    (tests/distributed/forked_cli.py: torch and glmtune imported there once, not in a fresh interpreter
    per run and rank; N gloo ranks as torchrun starts them). A run that exits non-zero fails the test
    with its output. stdout (every rank's, rank 0's first) and stderr come back apart, as `run` and
    torchrun give them; the files are beside the run directory (`<run_dir>.out`, `.err`)."""
    commands_in_forks({run_dir: argv[3:]}, nproc, stderr_apart=True, seconds_per_run=900.0)

    def printed_by_ranks(suffix: str) -> str:
        ranks = [f"{run_dir.name}{suffix}", *(f"{run_dir.name}.rank{r}{suffix}" for r in range(1, nproc))]
        return "".join((run_dir.parent / name).read_text() for name in ranks)

    return subprocess.CompletedProcess(argv, 0, printed_by_ranks(".out"), printed_by_ranks(".err"))


def _as_a_terminal_starts_it() -> None:
    """In the child before it runs glmtune: SIGINT's default action, as a terminal's foreground job has
    it. The test process may have been started with SIGINT ignored (a CI runner's shell without job
    control runs `.ci/run &` so), which a child would inherit, and glmtune keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(run_dir: Path, cache_dir: Path, *extra: str, recipe: str = "tiny/sft_support_json") -> subprocess.Popen:
    return subprocess.Popen(train_command(run_dir, cache_dir, *extra, recipe=recipe), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_as_a_terminal_starts_it)


def printed(output: str, text: str) -> bool:
    """Whether the console printed `text`: the console wraps lines at spaces, and a word longer than
    a line (a path) anywhere, so the comparison ignores whitespace."""
    return "".join(text.split()) in "".join(output.split())


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records}


def step_records(run_dir: Path, keys=("loss", "grad_norm", "val_loss", "tokens")) -> dict[int, tuple]:
    """step -> the values of `keys` (None where a record lacks one) from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: tuple(r.get(k) for k in keys) for r in records}


def assert_same_steps(actual: dict, expected: dict, rel: float = 1e-5) -> None:
    """Same steps, each value equal within `rel` (missing where the reference misses it)."""
    import pytest

    assert sorted(actual) == sorted(expected)
    for step, values in expected.items():
        for got, want in zip(actual[step], values):
            assert (got is None) == (want is None), step
            if want is not None:
                assert got == pytest.approx(want, rel=rel), step


class SharedRun(NamedTuple):
    run_dir: Path
    cache_dir: Path
    stdout: str


def shared_run(shared, *extra: str, recipe: str = "tiny/sft_support_json", nproc: int = 1) -> SharedRun:
    """`run` with these flags (as torchrun on `nproc` ranks when nproc > 1), made once per test
    session for every test asking for the same flags (`shared` is the `shared_results`
    fixture). Read it only: copy the run directory before resuming it. Other runs may use
    its data cache (entries are content-addressed and replaced atomically).

    The run goes through the CLI's entry point in processes forked from the gloo fork server
    (tests/distributed/forked_cli.py), torch and glmtune imported there once, not in a fresh
    interpreter per run (seconds each, several times a run's training on this tiny recipe).
    `stdout` is what the run printed to stdout (every rank's, rank 0's first), as `run` keeps it."""
    key = hashlib.sha256(json.dumps([recipe, nproc, *extra]).encode()).hexdigest()[:16]

    def build(root: Path) -> None:
        done = command_in_fork(train_command(root / "run", root / "cache", *extra, recipe=recipe), root / "run", nproc)
        (root / "stdout.txt").write_text(done.stdout)

    root = shared.get(f"run-{key}", build)
    return SharedRun(root / "run", root / "cache", (root / "stdout.txt").read_text())
