"""`throughput.py --lora` on CPU: glmtune's LoRA and transformers + PEFT (loading glmtune's
exported initial adapters) train the same inventory from the same weights and report the
same losses (bf16 rounding aside)."""

import json

from benchmarks.lora_bench import inventory_kind
from benchmarks.throughput import main


def test_lora_benchmark_trains_the_same_adapters_on_both_sides(tmp_path):
    out = tmp_path / "t.jsonl"
    argv = ["--tiny", "--seq", "48", "--docs", "2", "--steps", "2", "--warmup", "1", "--lora", "--lora-rank", "8",
            "--out", str(out)]
    assert main(argv) == 0
    ours, theirs, ratio = [json.loads(line) for line in out.read_text().splitlines()]
    assert (ours["impl"], theirs["impl"], ratio["impl"]) == ("glmtune-lora", "transformers+peft", "lora_ratio")
    assert ours["inventory"] == theirs["inventory"] and ours["inventory"]["routed_experts"] > 0
    assert not any(kind.startswith("other") for kind in ours["inventory"])
    assert ours["losses"][0] == theirs["losses"][0] or abs(ours["losses"][0] - theirs["losses"][0]) < 5e-3
    assert ratio["max_loss_diff"] < 0.02  # the adapters move the same way on both sides


def test_inventory_groups_name_both_sides_alike():
    assert inventory_kind("model.layers.1.mlp.experts.lora_gate_up_A") == "routed_experts"
    assert inventory_kind("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.default.weight") \
        == "routed_experts"
    assert inventory_kind("base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.default.weight") \
        == "attention.q_a_proj"
    assert inventory_kind("model.layers.2.mlp.shared_experts.up_proj.lora_B.weight") == "shared_experts"
