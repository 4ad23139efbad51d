"""`glmtune train RECIPE --nproc-per-node N`: torchrun started for the user, and refused early when it cannot run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from glmtune.cli import main
from glmtune.distributed.launch import pop_nproc_per_node, torchrun_command
from tests.train.run_helpers import WITH_EXPORT, env, losses, shared_run, train_command

# Four steps: the launched run and its reference are shared with tests/distributed/test_fsdp_train.py.
STEPS = WITH_EXPORT


def test_both_spellings_are_taken_out_and_the_rest_passed_on():
    assert pop_nproc_per_node(["--nproc-per-node", "2", "--optim.lr", "1e-3"]) == (["--optim.lr", "1e-3"], 2)
    assert pop_nproc_per_node(["--overwrite", "--nproc-per-node=4"]) == (["--overwrite"], 4)
    assert pop_nproc_per_node(["--nproc_per_node", "3", "--debug"]) == (["--debug"], 3)
    assert pop_nproc_per_node(["--train.max_steps", "2"]) == (["--train.max_steps", "2"], None)
    for tokens, message in ((["--nproc-per-node"], "--nproc-per-node expects a number of processes$"),
                            (["--nproc-per-node=two"], "expects a number of processes, got 'two'"),
                            (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            pop_nproc_per_node(tokens)
    # torchrun itself, run by glmtune.distributed.launch.torchrun_main (a signal: no traceback)
    assert torchrun_command(2, ["tiny/sft_support_json", "--overwrite"], debug=True) == [
        sys.executable, "-m", "glmtune.distributed.launch", "--standalone", "--nproc-per-node=2",
        "-m", "glmtune", "--debug", "train", "tiny/sft_support_json", "--overwrite"]


def test_refused_under_torchrun(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    assert main(["train", "tiny/sft_support_json", "--nproc-per-node", "2", "--logging.run_dir", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        "glmtune train: error: --nproc-per-node: this process is already one of 2 started by torchrun "
        "(WORLD_SIZE is set); drop --nproc-per-node\n")
    assert not run_dir.exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--parallel.tp", "2"], "parallel.tp is 2, but tensor parallelism is not built in this version yet; "
                             "set parallel.tp: 1"),
    (["--parallel.dp_shard", "4"], "parallel.dp_replicate x dp_shard x cp x tp x pp = 1 x 4 x 1 x 1 x 1 = 4, "
                                   "but the world size is 2 (set parallel.dp_shard: -1 to fill)"),
    (["--parallel.launcher", "slurm", "--parallel.nodes", "1", "--parallel.gpus_per_node", "2"],
     "--nproc-per-node starts torchrun on this host, but parallel.launcher is slurm; "
     "set --parallel.launcher torchrun"),
])
def test_a_layout_that_cannot_run_starts_nothing(extra, message, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run_dir = tmp_path / "run"
    argv = ["train", "tiny/sft_support_json", "--nproc-per-node", "2", "--logging.run_dir", str(run_dir), *extra]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"glmtune train: error: {message}\n"
    assert not run_dir.exists()


def test_direct_torchrun_refuses_before_writing(tmp_path):
    """Each rank runs the same validation first: the refusal writes no run directory."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *train_command(run_dir, cache, "--parallel.tp", "2")[1:]]
    result = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "glmtune train: error: parallel.tp is 2, but tensor parallelism is not built" in result.stderr
    assert not run_dir.exists() and not cache.exists()


def test_nproc_per_node_trains_like_one_process(shared_results):
    """Two gloo ranks started by the launcher give the single-process losses (same global batch)."""
    launched = shared_run(shared_results, *STEPS, "--nproc-per-node", "2")
    assert "world 2 = dp_replicate 1 x dp_shard 2" in launched.stdout
    single = shared_run(shared_results, *STEPS)
    expected, actual = losses(single.run_dir), losses(launched.run_dir)
    assert sorted(actual) == [1, 2, 3, 4]
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), step


def test_sigusr1_to_the_launcher_stops_every_rank_through_the_stop_file(tmp_path):
    """torchrun has no SIGUSR1 handler: the launcher turns the signal into the run's stop file."""
    import signal
    import time

    from tests.train.run_helpers import start

    run_dir = tmp_path / "run"
    process = start(run_dir, tmp_path / "cache", "--train.max_steps", "200", "--checkpoint.every_steps", "0",
                    "--nproc-per-node", "2")
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 130, output
    assert "stop file" in output and "continue with --checkpoint.resume auto" in output
    assert list((run_dir / "checkpoints").glob("step-*")) and not (run_dir / "STOP_REQUESTED").exists()
