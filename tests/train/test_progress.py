"""What `glmtune train` shows while it trains: one plain line per logged step when stdout is
not a terminal (a Slurm log, a pipe), rich's live bar on a terminal, nothing with
`logging.progress: false`."""

from __future__ import annotations

import os
import pty
import re
import subprocess

from tests.train.run_helpers import TWO_STEPS, env, run, shared_run, train_command

PLAIN = re.compile(r"^step (\d+)/8  loss \d+\.\d{4}  grad_norm \d+\.\d{3}  lr \d\.\d\de[-+]\d\d  tok/s \d+  "
                   r"eta \d+:\d\d:\d\d$")


def test_plain_lines_for_logged_steps_when_stdout_is_not_a_terminal(tmp_path):
    cache = tmp_path / "cache"
    shown = run(tmp_path / "shown", cache, "--logging.progress", "true", "--train.log_every", "3")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = [line for line in shown.stdout.splitlines() if line.startswith("step ")]
    assert all(PLAIN.match(line) for line in lines), lines
    assert [int(PLAIN.match(line).group(1)) for line in lines] == [3, 6, 8]  # the metrics file's steps
    assert "\x1b[" not in shown.stdout  # no bar drawn into the pipe
    # The metrics file's throughput is the logging window's (the first step's compile left out).
    import json

    from glmtune.models.glm5 import get_preset
    from glmtune.models.glm5.flops import active_matmul_params, flops_per_token

    record = [json.loads(line) for line in (tmp_path / "shown" / "metrics.jsonl").read_text().splitlines()][1]
    assert record["step"] == 6 and record["step_s"] > 0 and record["data_wait_s"] >= 0
    assert 0 < record["tokens_per_s_no_padding"] < record["tokens_per_s"]  # rows are padded to 256
    args = get_preset("tiny")  # model FLOPs per token: the matmuls plus at most 256-token causal attention
    per_token = record["tflops"] * 1e12 / record["tokens_per_s"]
    assert 6 * active_matmul_params(args, 4, 2) < per_token <= flops_per_token(args, 4, 2, [256])
    assert "mfu" not in record and "peak_memory_gib" not in record  # a CPU has no bf16 peak or CUDA allocator


def test_no_progress_output_when_switched_off(shared_results):
    quiet = shared_run(shared_results, *TWO_STEPS)  # SMALL: logging.progress false
    assert not [line for line in quiet.stdout.splitlines() if line.startswith("step ")]


def test_a_terminal_gets_the_live_bar_instead(tmp_path):
    leader, follower = pty.openpty()
    command = train_command(tmp_path / "run", tmp_path / "cache", "--logging.progress", "true")
    proc = subprocess.Popen(command, env=env(), stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:  # read as it comes: a full pty buffer would block the run
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the run closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "step 8/8" in shown and "tok/s" in shown  # the bar's columns
    assert "grad_norm" not in shown  # and no plain lines
