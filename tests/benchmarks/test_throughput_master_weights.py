"""The throughput benchmark's fp32-master-weights option on CPU: the proxy trains with fp32
parameters and bf16 compute beside the bf16-only run, from the same weights and batches."""

import json

import torch.distributed as dist

from benchmarks.throughput import main


def test_fp32_master_weights_run_beside_bf16_only(tmp_path):
    out = tmp_path / "t.jsonl"
    argv = ["--tiny", "--seq", "48", "--docs", "2", "--steps", "2", "--warmup", "1", "--impl", "glmtune",
            "--master-weights", "both", "--out", str(out)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["impl"] for line in lines] == ["glmtune", "glmtune-fp32-master", "fp32_master_vs_bf16"]
    bf16_only, masters, cost = lines
    assert (bf16_only["master_weights"], masters["master_weights"]) == ("none", "fp32")
    # Step one computes on the same bf16 weights: the same loss to the bit; then only the updates differ.
    assert masters["losses"][0] == bf16_only["losses"][0]
    assert 0 <= cost["max_loss_diff"] < 0.05 and cost["speedup"] > 0
    assert not dist.is_initialized()  # the one-rank group is gone with the run
