"""`glmtune plan` end to end: GLM-5's recipe on H100 and H200, the tiny recipe with its real data,
time and cost arithmetic, measured speeds read from where glmtune writes them, refusals."""

from __future__ import annotations

import json

import pytest

from glmtune.cli import main
from glmtune.config import load_config
from glmtune.plan.cost import FailureBudget, run_cost
from glmtune.plan.measure import planned_for
from glmtune.plan.planner import degrees_for
from glmtune.plan.throughput_source import read_measurement, tokens_per_s_per_gpu


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_glm5_sft_4k_on_h100_and_h200(capsys):
    report = _plan(capsys, "recipes/glm5/sft_4k.yaml", "--no-data")
    assert report["layout"]["world_size"] == 256 and report["layout"]["pp"] == 4 and report["layout"]["ep"] == 64
    by_gpu = {g["gpu"]: g for g in report["gpus"]}
    assert set(by_gpu) == {"h100-80g", "h200-141g"}
    peak_gib = report["memory"]["peak_bytes"] / 2**30
    assert 40 < peak_gib < 80  # the state alone is 16 B x 754B / 256 ranks = 44 GiB
    parts, state = report["memory"]["peak_parts"], report["memory"]["state"]
    # fp32 masters in the optimizer: 2 B of bf16 parameters + 12 B of AdamW (master, two moments) per
    # 2 B of bf16 gradients, frozen parameters aside (the busiest rank is the last stage, which holds
    # the frozen MTP layer: ~5% of its parameters)
    assert report["memory"]["rank"] == 192
    assert abs(parts["parameters"] + parts["optimizer state"] - 7 * state["grads"]) < 0.06 * parts["parameters"]
    # the peak is early in the backward, where a pipeline's units have reduced few gradients yet
    assert report["memory"]["peak_phase"].endswith("backward") and parts["gradients"] < 0.5 * state["grads"]
    for gpu in by_gpu.values():
        assert gpu["recipe_layout"]["fits"] == (gpu["recipe_layout"]["free_gib"] >= 0)
        # the recipe's 256 on an H200; an H100 (79.2 GiB usable) needs 512 once the plan's 74.9 GiB
        # (measured 70.9) and its 2.5 GiB + 5% headroom exceed it
        assert gpu["smallest_fit"]["gpus"] <= 512
    assert by_gpu["h200-141g"]["smallest_fit"]["gpus"] < by_gpu["h100-80g"]["smallest_fit"]["gpus"]
    assert report["data"]["note"].startswith("not read")


def test_the_mtp_loss_counts_its_layer_state_and_its_last_stage_memory(capsys):
    """With `train.mtp_loss_weight` the MTP layer trains (its gradients and AdamW state count) and the
    last stage holds its activations, its loss rows and its own head weight gradient at the forward's end."""
    mtp = _plan(capsys, "recipes/glm5/sft_4k.yaml", "--no-data", "--train.mtp_loss_weight", "0.3")
    assert mtp["memory"]["rank"] == 192  # the last stage's first rank is the busiest with it
    # rank 192 with and without it (without, another rank can be the busiest)
    base, with_mtp = (planned_for(cfg, degrees_for(cfg), 192) for cfg in (
        load_config("recipes/glm5/sft_4k.yaml", ["--train.mtp_loss_weight", weight]) for weight in ("0", "0.3")))
    state, state_mtp = base.state.to_dict(), with_mtp.state.to_dict()
    # GLM-5's MTP layer (a MoE layer with an indexer and its glue, ~9.95B parameters) lives on the last
    # stage, sharded over its 64 dp_shard ranks (experts: over the 64 ep ranks): ~155M on rank 192
    assert abs((state_mtp["trainable_params"] - state["trainable_params"]) - 9.95e9 / 64) < 0.05 * 9.95e9 / 64
    assert with_mtp.peak.total > base.peak.total
    assert "the MTP loss (weight 0.3" in mtp["objective"]


def test_tiny_recipe_counts_its_packed_data_and_prices_the_run(capsys):
    report = _plan(capsys, "recipes/tiny/sft_support_json.yaml", "--gpu", "h200-141g", "--tflops-per-gpu", "100",
                   "--price-per-gpu-hour", "2.5", "--restarts", "0", "--train.max_steps", "50")
    data, run = report["data"], report["run"]
    assert data["rows"] > 0 and data["seq"] == 512 and data["real_tokens"] <= data["tokens"] == data["rows"] * 512
    assert run == {"steps": 50, "tokens": 50 * 8 * 512, "source": "train.max_steps"}
    cost = report["gpus"][0]["time"]
    assert cost["restarts"] == 0 and cost["restart_hours"] == 0
    assert cost["compute_hours"] == pytest.approx(run["tokens"] / cost["tokens_per_s_per_gpu"] / 3600, rel=1e-3)
    assert cost["cost"] == pytest.approx(cost["gpu_hours"] * 2.5, rel=1e-3, abs=0.01)


def test_cost_arithmetic():
    c = run_cost(tokens=3_600_000, steps=100, gpus=10, tokens_per_s_per_gpu=100.0, checkpoint_bytes_per_rank=36e9,
                 saves=2, async_save=False, budget=FailureBudget(write_gbps=1.0, restart_minutes=30, restarts=1),
                 price=2.0)
    assert c.compute_h == pytest.approx(1.0)  # 3.6M tokens / 1000 tok/s
    assert c.checkpoint_h == pytest.approx(2 * 36 / 3600)  # 36 GB at 1 GB/s, twice
    assert c.restart_h == pytest.approx(0.5 + 0.25)  # 30 minutes + half of a 0.5 h save interval
    assert c.gpu_hours == pytest.approx(10 * c.wall_h) and c.cost == pytest.approx(2 * c.gpu_hours)


def test_a_runs_metrics_give_the_steady_speed(tmp_path):
    windows = [{"step": 10, "tflops": 50.0, "mfu": 0.05}, {"step": 20, "tflops": 400.0, "mfu": 0.4044},
               {"step": 30, "tflops": 420.0, "mfu": 0.4247}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    m = read_measurement(tmp_path)
    assert m.tflops_per_gpu == 410.0 and m.windows == 2  # the first window holds compilation
    assert m.gpu_peak_tflops == pytest.approx(989, rel=1e-3)
    per_gpu, note = tokens_per_s_per_gpu(m, 1e9, "b200-180g")  # scaled by the peaks, same MFU
    assert per_gpu == pytest.approx(410e12 * 2250 / m.gpu_peak_tflops / 1e9) and "same MFU" in note


def test_refusals_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    assert main(["plan", "recipes/tiny/sft_support_json.yaml", "--throughput", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    assert main(["plan", "recipes/tiny/sft_support_json.yaml", "--throughput", str(tmp_path),
                 "--tflops-per-gpu", "3"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["plan", "recipes/tiny/sft_support_json.yaml", "--no-such.key", "1"]) == 2
    assert "unknown key" in capsys.readouterr().err
