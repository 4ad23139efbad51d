"""The throughput benchmark's plumbing on CPU: both implementations train the same narrow
proxy from the same weights and batches and report the same losses (bf16 rounding aside)."""

import json

from benchmarks.throughput import main


def test_benchmark_runs_both_and_losses_agree(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["--tiny", "--seq", "48", "--docs", "2", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["transformers", "glmtune", "ratio"]
    hf, ours, ratio = lines
    assert len(hf["losses"]) == len(ours["losses"]) == 3
    assert abs(hf["losses"][0] - ours["losses"][0]) < 5e-3  # same weights, same first batch
    assert ratio["max_loss_diff"] < 0.05
    assert ours["tflops"] >= 0 and ours["tok_s"] > 0
