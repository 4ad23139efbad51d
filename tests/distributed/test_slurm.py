"""`glmtune slurm`: the sbatch script of a multi-node run, and that script run on CPU without Slurm.

The script of the 32-node GLM-5 recipe carries the allocation, one torchrun per node with a
c10d rendezvous on the first node and `--checkpoint.resume auto`; bad flags and layouts are
one line with nothing written. Then the generated script itself runs under bash with
stand-in `srun` (one task per "node" on this host, with Slurm's task variables) and
`scontrol` (hostnames; requeue recorded), 2 nodes x 2 gloo ranks: USR1 mid-run saves one
checkpoint and requeues, TERM in the requeued job saves without a requeue, and the third
start ends with the losses of one uninterrupted process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.distributed.slurm import STOP_FILE, time_limit_seconds, write_script
from tests.train.run_helpers import SMALL, env, losses, run_in_fork

REPO = Path(__file__).resolve().parents[2]


def _dry_run(capsys, *argv: str) -> str:
    assert main(["slurm", *argv, "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_the_32_node_glm5_script(tmp_path, capsys):
    run_dir = tmp_path / "run"
    script = _dry_run(capsys, "recipes/glm5/sft_4k.yaml", "--nodes", "32", "--partition", "gpu", "--time",
                      "2-00:00:00", "--account", "proj", "--signal-lead", "900",
                      "--model.name_or_path", "/data/GLM-5", "--logging.run_dir", str(run_dir))
    assert not tmp_path.joinpath("run").exists()  # --dry-run writes nothing
    sbatch = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == [
        "--job-name=glm5-sft-4k", "--nodes=32", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive",
        "--mem=0", "--partition=gpu", "--time=2-00:00:00", "--account=proj", "--requeue", "--signal=B:USR1@900",
        "--open-mode=append", f"--output={run_dir}/slurm/%x-%j.out", f"--error={run_dir}/slurm/%x-%j.err"]
    assert script.startswith("#!/bin/bash\n")
    assert 'MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    command = " ".join(script.split("\nsrun ", 1)[1].split("\nSRUN_PID=$!")[0].replace("\\\n", " ").split())
    assert command == (
        '--ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" '
        f"{sys.executable} -m torch.distributed.run --nnodes \"$SLURM_NNODES\" --nproc-per-node 8 "
        '--rdzv-backend c10d --rdzv-endpoint "$MASTER_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" '
        f"-m glmtune train {REPO}/recipes/glm5/sft_4k.yaml --model.name_or_path /data/GLM-5 "
        f"--logging.run_dir {run_dir} --parallel.launcher slurm --parallel.nodes 32 --parallel.gpus_per_node 8 "
        "--checkpoint.resume auto &")
    for setting in ("TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "NCCL_ASYNC_ERROR_HANDLING=1", "TORCH_NCCL_BLOCKING_WAIT=0",
                    "NCCL_DEBUG=WARN", "RDZV_PORT=29500", f'STOP_FILE="$RUN_DIR/{STOP_FILE}"',
                    f"RUN_DIR={run_dir}", f"cd {Path.cwd()}"):
        assert setting in script, setting
    assert "trap 'request_stop USR1' USR1" in script and "trap 'request_stop TERM' TERM" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "16"], "--nodes 16 disagrees with parallel.nodes (32) in the recipe; pass --nodes 32, or change "
                        "the recipe with --parallel.nodes 16"),
    (["--nodes", "32", "--gpus-per-node", "4"],
     "--gpus-per-node 4 disagrees with parallel.gpus_per_node (8) in the recipe; pass --gpus-per-node 8, or change "
     "the recipe with --parallel.gpus_per_node 4"),
    (["--nodes", "32", "--parallel.dp_shard", "32"], "parallel.dp_replicate x dp_shard x cp x tp x pp = "
                                                    "1 x 32 x 1 x 1 x 4 = 128, but the world size is 256"),
    (["--nodes", "32", "--time", "9 hours"], "--time '9 hours' is not a Slurm time limit"),
    (["--nodes", "32", "--time", "10:00"], "--signal-lead 600 s is not shorter than --time 10:00 (600 s)"),
    (["--nodes", "32", "--signal-lead", "70000"], "--signal-lead must be between 1 and 65535 seconds, got 70000"),
    (["--nodes", "0"], "argument --nodes: must be >= 1, got 0"),
    (["--gpus-per-node", "8"], "--nodes is required"),
    (["--nodes", "32", "--overwrite"], "--overwrite: every requeue of the job would remove the checkpoints"),
    (["--nodes", "32", "--checkpoint.resume", "none"], "--checkpoint.resume none: the job passes --checkpoint"),
    (["--nodes", "32", "--nproc-per-node", "8"], "--nproc-per-node: the job starts one torchrun per node itself"),
])
def test_bad_flags_and_layouts_are_one_line_and_write_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch either: the refusal comes first
    run_dir = tmp_path / "run"
    assert main(["slurm", "recipes/glm5/sft_4k.yaml", *argv, "--logging.run_dir", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"glmtune slurm: error: {message}") and captured.err.count("\n") == 1
    assert not run_dir.exists()


def test_without_sbatch_it_suggests_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    run_dir = tmp_path / "run"
    assert main(["slurm", "tiny/sft_support_json", "--nodes", "2", "--gpus-per-node", "1",
                 "--logging.run_dir", str(run_dir)]) == 2
    assert capsys.readouterr().err == ("glmtune slurm: error: sbatch is not on PATH (not a Slurm login node?); "
                                       "--dry-run prints the script instead\n")
    assert not run_dir.exists()


def test_submits_the_script_it_wrote_and_never_overwrites(tmp_path, capsys, monkeypatch):
    bin_dir = _executable(tmp_path / "bin" / "sbatch", f"""#!/bin/bash
cp "$1" {tmp_path}/submitted.sh
echo "Submitted batch job 4242"
""").parent
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    argv = ["slurm", "tiny/sft_support_json", "--nodes", "2", "--gpus-per-node", "1", "--logging.run_dir",
            str(run_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    written = sorted((run_dir / "slurm").iterdir())
    assert len(written) == 1 and written[0].name.endswith("-sbatch.sh")
    assert out.endswith("Submitted batch job 4242\n") and written[0].name in out
    assert (tmp_path / "submitted.sh").read_text() == written[0].read_text() == _dry_run(capsys, *argv[1:])

    # A name that is taken (another submission in the same second, or the user's file) stays as it is.
    taken = write_script(run_dir, "first\n", stamp="20261201-120000")
    again = write_script(run_dir, "second\n", stamp="20261201-120000")
    assert taken.name == "20261201-120000-sbatch.sh" and again.name == "20261201-120000-2-sbatch.sh"
    assert taken.read_text() == "first\n" and again.read_text() == "second\n"
    assert not [p for p in (run_dir / "slurm").iterdir() if p.name.startswith(".")]


def test_time_limits_in_slurm_formats():
    assert [time_limit_seconds(t) for t in ("30", "30:15", "2:00:00", "1-0", "1-02:30", "1-02:30:05", "UNLIMITED")] \
        == [1800, 1815, 7200, 86400, 95400, 95405, None]


# -- the script, run -------------------------------------------------------------------------------------


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _stand_ins(bin_dir: Path, record: Path) -> None:
    """srun and scontrol as Slurm behaves for a batch script of 2 nodes, both this host."""
    _executable(bin_dir / "srun", f"""#!/bin/bash
# One task per node of the allocation, with the variables slurmstepd sets for a task.
while [ $# -gt 0 ]; do
    case "$1" in
        --ntasks-per-node=1|--kill-on-bad-exit=1|--cpus-per-task=*) shift ;;
        -*) echo "stand-in srun: unexpected option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES SLURM_STEP_ID=0 \\
    SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NUM_TASKS=$SLURM_NNODES SLURMD_NODENAME=localhost "$@" &
    pids+=($!)
done
status=0
for pid in "${{pids[@]}}"; do
    wait "$pid"; rc=$?
    if [ "$rc" -gt "$status" ]; then status=$rc; fi
done
echo "srun $SLURM_NNODES tasks: exit $status" >> {record}
exit "$status"  # srun's: the highest exit status of its tasks
""")
    _executable(bin_dir / "scontrol", f"""#!/bin/bash
case "$1 $2" in
    "show hostnames") tr ',' '\\n' <<< "$3" ;;
    requeue\\ *) echo "requeue $2" >> {record} ;;
    *) echo "stand-in scontrol: unexpected $*" >&2; exit 2 ;;
esac
""")


def _rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range (net.ipv4.ip_local_port_range). The script's three
    starts reuse its port over minutes while the other xdist worker's tests open connections from
    ephemeral ports, any of which may be the one a bind to port 0 handed out: in a CI run the third
    start's agents timed out connecting to a store that never came up there. Below the range only an
    explicit bind can take it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.is_file() else 32768
    rng = random.Random(os.getpid())
    for _ in range(200):
        port = rng.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in 20000-{low}")


def _metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


class _Job:
    """One start of the batch script, as slurmd would run it on the first node: bash, a log file."""

    def __init__(self, script: Path, log: Path, environment: dict[str, str]) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["bash", str(script)], cwd=REPO, env=environment, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def signal_when(self, predicate, signum: int, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.proc.poll() is None, f"ended early ({self.proc.returncode}):\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, self.text()[-4000:]
            time.sleep(0.02)
        self.proc.send_signal(signum)  # the batch shell alone, as with --signal=B:...

    def finish(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # this job's own process group

    def text(self) -> str:
        return self.log.read_text()


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


def test_the_script_under_stand_in_slurm_stops_requeues_and_resumes_exactly(tmp_path, capsys):
    cache, run_dir, record = tmp_path / "cache", tmp_path / "run", tmp_path / "slurm-calls.log"
    steps = ["--train.max_steps", "10", "--checkpoint.every_steps", "0", "--train.global_batch_size", "8",
             "--train.device", "cpu"]  # 4 ranks x micro-batch 2
    single = run_in_fork(tmp_path / "single", cache, *steps)  # the reference: one process, forked warm
    assert single.returncode == 0, single.stdout + single.stderr
    expected = losses(tmp_path / "single")

    text = _dry_run(capsys, "tiny/sft_support_json", "--nodes", "2", "--gpus-per-node", "2",
                    "--rdzv-port", str(_rendezvous_port()), *SMALL, *steps, "--parallel.dp_shard", "4",
                    "--logging.progress", "true", "--logging.run_dir", str(run_dir), "--data.cache_dir", str(cache))
    script = tmp_path / "job.sh"
    script.write_text(text)
    bin_dir = tmp_path / "bin"
    _stand_ins(bin_dir, record)
    environment = {**env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
                   "SLURM_JOB_NAME": "glmtune", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                   "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_CPUS_ON_NODE": "2",
                   "SLURM_SUBMIT_DIR": str(REPO)}
    environment.pop("WORLD_SIZE", None)

    # 1: the time-limit warning after step 2: one checkpoint, the stop file taken, requeued.
    first = _Job(script, tmp_path / "first.log", environment)
    first.signal_when(lambda: _metric_lines(run_dir) >= 2, signal.SIGUSR1)
    assert first.finish() == 130, first.text()[-4000:]
    log = first.text()
    assert "glmtune slurm: SIGUSR1: asking the training to save a checkpoint and stop" in log
    assert "world 4 = dp_replicate 1 x dp_shard 4" in log
    saved = _checkpoints(run_dir)
    assert len(saved) == 1 and 2 <= saved[0] < 10, saved
    assert _squeezed(f"stop file {run_dir / STOP_FILE}: saved") in _squeezed(log)  # rich wraps at 80 columns
    assert not (run_dir / STOP_FILE).exists()
    assert record.read_text().splitlines() == ["srun 2 tasks: exit 1", "requeue 4242"]  # torchrun: 1 for 130

    # 2: the requeued job resumes; SIGTERM (scancel, preemption) saves again but is not requeued.
    second = _Job(script, tmp_path / "second.log", environment)
    second.signal_when(lambda: _metric_lines(run_dir) > saved[0], signal.SIGTERM)
    assert second.finish() == 130, second.text()[-4000:]
    log = second.text()
    assert _squeezed(f"step-{saved[0]:08d} at step {saved[0]}") in _squeezed(log)
    assert "(SIGTERM: not requeued)" in log
    resaved = _checkpoints(run_dir)
    assert len(resaved) == 2 and saved[0] < resaved[1] < 10, resaved
    assert record.read_text().splitlines()[2:] == ["srun 2 tasks: exit 1"]

    # 3: started again, it runs to the end: the losses of one uninterrupted process.
    third = _Job(script, tmp_path / "third.log", environment)
    assert third.finish() == 0, third.text()[-4000:]
    actual = losses(run_dir)
    assert sorted(actual) == list(range(1, 11))
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=1e-5), step
    log = third.text()
    # The Slurm log is not a terminal: one plain line per logged step of this start.
    progress = [line for line in log.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == [f"{s}/10" for s in range(resaved[1] + 1, 11)]
    assert record.read_text().splitlines()[3:] == ["srun 2 tasks: exit 0"]
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 10
