"""Ctrl-C at any moment of `glmtune train` is "interrupted", exit status 130, and no traceback:
during the imports of the first seconds, and under the `--nproc-per-node` launcher (whose
torchrun and ranks are all gone when it exits)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import glmtune.cli
from glmtune.cli import interrupts_deferred, main
from tests.train.run_helpers import env, train_command

# Long enough that no run finishes before the signal; nothing trains that long here.
LONG = ["--train.max_steps", "500", "--optim.warmup_steps", "0"]


def test_a_ctrl_c_inside_the_block_is_held_until_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler has run by now; it must not have raised
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_while_the_parser_is_built_is_interrupted(monkeypatch, capsys):
    def interrupted_import():
        raise KeyboardInterrupt

    monkeypatch.setattr(glmtune.cli, "build_parser", interrupted_import)
    monkeypatch.delenv("GLMTUNE_DEBUG", raising=False)
    assert main(["train", "recipe.yaml", "--optim.lr", "1"]) == 130
    assert capsys.readouterr().err == "glmtune train: interrupted\n"
    assert main(["nonsense"]) == 130
    assert capsys.readouterr().err == "glmtune: interrupted\n"
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback, for a bug report
        main(["--debug", "train", "recipe.yaml"])


def _assert_interrupted(process: subprocess.Popen, output: str) -> None:
    assert process.returncode == 130, output[-3000:]
    assert "interrupted" in output and "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0])
def test_ctrl_c_during_start_up(delay, tmp_path):
    """0.3-2 s in: the subcommands (torch among them) are still being imported, or the recipe read."""
    process = subprocess.Popen(train_command(tmp_path / "run", tmp_path / "cache", *LONG), env=env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    _assert_interrupted(process, output)


def _children(pid: int) -> set[int]:
    """The live descendants of `pid` (from /proc: ppid is the 4th field of /proc/PID/stat)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize(("delay", "presses"), [(0.0, 1), (2.0, 2)])
def test_ctrl_c_to_the_launcher_stops_torchrun_and_its_ranks(delay, presses, tmp_path):
    """SIGINT to the launcher once its 2 ranks exist (still starting, then importing): status
    130, no traceback from any process, and none of them left; a second Ctrl-C is not passed
    on (it would cut torchrun's shutdown short)."""
    command = train_command(tmp_path / "run", tmp_path / "cache", *LONG, "--nproc-per-node", "2")
    process = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    children: set[int] = set()
    while len(children) < 3:  # torchrun and its two ranks
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.1)
        children = _children(process.pid)
    time.sleep(delay)
    children |= _children(process.pid)
    for _ in range(presses):
        process.send_signal(signal.SIGINT)
        time.sleep(0.2)
    output, _ = process.communicate(timeout=90)
    _assert_interrupted(process, output)
    assert "torchrun and its 2 ranks have stopped" in output
    assert not _alive(children), output[-3000:]
