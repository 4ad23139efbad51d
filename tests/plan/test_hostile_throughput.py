"""`glmtune plan --throughput` reads a run's metrics.jsonl as untrusted: bytes that are not UTF-8 are
one line naming the file and line (exit 2), and a last line cut short (a run still writing it, or
killed) ends the file instead of failing the plan."""

from __future__ import annotations

import json

import pytest

from glmtune.cli import main
from glmtune.plan.throughput_source import read_measurement

RECIPE = "recipes/glm5/sft_4k.yaml"
RECORD = {"step": 10, "tflops": 400.0, "gpu": "NVIDIA H200"}


@pytest.mark.parametrize("line, said", [
    (b'{"step": 20, "tflops": "\xff"}', ":2: not valid JSON"),
    (b"\xfe\xff\x00{", ":2: not valid JSON"),
    (b'{"step": 20, "x": ' + b"[" * 100 + b"]" * 100 + b"}", ":2: JSON nested deeper than 64 levels"),
])
def test_a_hostile_metrics_line_is_one_line_naming_file_and_line(tmp_path, capsys, line, said):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(json.dumps(RECORD).encode() + b"\n" + line + b"\n")
    assert main(["plan", RECIPE, "--no-data", "--throughput", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glmtune plan: error: {metrics}{said}") and err.count("\n") == 1, err


def test_a_last_line_cut_short_ends_the_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({**RECORD, "step": s}) + "\n" for s in (10, 20, 30)) + '{"step": 40, "tfl')
    assert read_measurement(tmp_path).windows == 2  # 20 and 30 (10 compiles); 40 was being written
