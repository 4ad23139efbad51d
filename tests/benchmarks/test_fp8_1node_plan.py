"""The one-node FP8 plan reads the recipe's model on the meta device: the routed experts'
share is the arithmetic of their e4m3 bytes over EP 8, and the verdict follows the GPU size."""

from benchmarks.fp8_1node_plan import main

RECIPE = "recipes/glm5/lora_fp8_1node.yaml"


def test_plan_counts_the_fp8_experts_and_judges_the_fit(capsys):
    assert main([RECIPE]) == 0
    out = capsys.readouterr().out
    # 76 MoE layers (75 + MTP) x 256 experts x 3 x 6144 x 2048 e4m3 bytes (+ 1/16384 in scales) / 8
    expected = 76 * 256 * 3 * 6144 * 2048 * (1 + 4 / 128**2) / 8 / 2**30
    line = next(line for line in out.splitlines() if "routed experts" in line)
    assert abs(float(line.split()[-2]) - expected) < 0.1, (line, expected)
    assert ": fits" in out
    assert main([RECIPE, "--gpu-gib", "80"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
