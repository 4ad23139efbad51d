"""`glmtune plan`'s numeric inputs are finite and in range: each bad value is one line naming the
option (exit status 2), before any recipe is read; a measured speed file's NaN and Infinity
(which Python's json reads) and a line nested thousands deep are not a speed."""

from __future__ import annotations

import json

import pytest

from glmtune.cli import main
from glmtune.plan.throughput_source import read_measurement

RECIPE = "recipes/glm5/sft_4k.yaml"


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--price-per-gpu-hour", "nan", "--price-per-gpu-hour must be a finite number > 0, got nan"),
    ("--price-per-gpu-hour", "inf", "--price-per-gpu-hour must be a finite number > 0, got inf"),
    ("--price-per-gpu-hour", "-2", "--price-per-gpu-hour must be a finite number > 0, got -2.0"),
    ("--fragmentation", "-0.5", "--fragmentation must be a finite number in [0, 1], got -0.5"),
    ("--fragmentation", "nan", "--fragmentation must be a finite number in [0, 1], got nan"),
    ("--fragmentation", "3", "--fragmentation must be a finite number in [0, 1], got 3.0"),
    ("--headroom-gib", "-80", "--headroom-gib must be a finite number >= 0, got -80.0"),
    ("--headroom-gib", "inf", "--headroom-gib must be a finite number >= 0, got inf"),
    ("--tflops-per-gpu", "nan", "--tflops-per-gpu must be a finite number > 0, got nan"),
    ("--tflops-per-gpu", "0", "--tflops-per-gpu must be a finite number > 0, got 0.0"),
    ("--epochs", "nan", "--epochs must be a finite number > 0, got nan"),
    ("--epochs", "inf", "--epochs must be a finite number > 0, got inf"),
    ("--write-gbps", "nan", "--write-gbps must be a finite number > 0, got nan"),
    ("--restart-minutes", "nan", "--restart-minutes must be a finite number >= 0, got nan"),
    ("--restart-minutes", "-20", "--restart-minutes must be a finite number >= 0, got -20.0"),
    ("--gpus", "0", "--gpus must be >= 1, got 0"),
    ("--gpus", "-8", "--gpus must be >= 1, got -8"),
    ("--max-gpus", "0", "--max-gpus must be >= 1, got 0"),
    ("--restarts", "-1", "--restarts must be >= 0, got -1"),
])
@pytest.mark.parametrize("before_recipe", [False, True])
def test_each_bad_number_is_one_line_naming_the_option(option, value, message, before_recipe, capsys):
    flag = f"{option}={value}"  # `--x -8` would read -8 as an option
    argv = ["plan", flag, RECIPE, "--no-data"] if before_recipe else ["plan", RECIPE, "--no-data", flag]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"glmtune plan: error: {message}\n"


def test_a_refused_option_prints_no_plan(capsys):
    assert main(["plan", RECIPE, "--no-data", "--fragmentation=-0.9", "--json"]) == 2
    assert capsys.readouterr().out == ""


def test_a_speed_above_the_gpus_peak_is_refused(capsys):
    assert main(["plan", RECIPE, "--no-data", "--gpu", "h100-80g", "--tflops-per-gpu", "5000"]) == 2
    assert capsys.readouterr().err == (
        "glmtune plan: error: --tflops-per-gpu 5000 is above the dense bf16 peak of h100-80g (989 TFLOP/s), which "
        "no run reaches; give the model TFLOP/s per GPU measured\n")


def test_non_finite_speeds_in_a_metrics_file_are_skipped(tmp_path):
    lines = ['{"step": 10, "tflops": 50.0}', '{"step": 20, "tflops": Infinity, "mfu": 0.4}',
             '{"step": 30, "tflops": NaN}', '{"step": 40, "tflops": 400.0, "mfu": NaN, "gpu": "NVIDIA H200"}',
             '{"step": 50, "tflops": 420.0, "mfu": Infinity}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    m = read_measurement(tmp_path)
    assert m.tflops_per_gpu == 410.0 and m.windows == 2  # 400 and 420 (50 is the first window, compiling)
    assert m.gpu_peak_tflops is None  # mfu Infinity is no MFU; the last window names no GPU
    (tmp_path / "metrics.jsonl").write_text('{"tflops": Infinity}\n{"tflops": -3}\n')
    with pytest.raises(ValueError, match="no glmtune record with a positive `tflops`"):
        read_measurement(tmp_path)


def test_a_deeply_nested_line_is_one_line_naming_file_and_line(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "tflops": 1.0}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["plan", RECIPE, "--no-data", "--throughput", str(metrics)]) == 2
    assert capsys.readouterr().err == f"glmtune plan: error: {metrics}:2: JSON nested deeper than 64 levels\n"
    metrics.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: a JSON object per line expected, got list"):
        read_measurement(metrics)
