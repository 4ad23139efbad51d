"""The training alternative's cost beside the verdict (glmtune/decide/cost.py): the plan's own
figures for a GLM-5 recipe (`glmtune.plan.assemble.build_plan`, the same GPU-hours, wall time and
cost, its speed source named), and the options refused when they would not take effect."""

from __future__ import annotations

import pytest

from glmtune.config import load_config
from glmtune.decide.cost import CostOptions, cost_line, plan_cost
from glmtune.plan.assemble import PlanOptions, build_plan
from glmtune.plan.throughput_source import Measurement

GLM5 = "recipes/glm5/lora_fp8_1node.yaml"


def test_a_glm5_recipes_cost_is_the_plans_own():
    # 194.7 model TFLOP/s per GPU: the one-node FP8 LoRA rank measured on an H200 (docs/benchmarks.md)
    options = CostOptions(GLM5, tflops_per_gpu=194.7, measured_gpu="h200-141g", gpus=["h200-141g"],
                          price_per_gpu_hour=3.5)
    options.check()
    cost = plan_cost(options)
    plan = build_plan(load_config(GLM5), GLM5, PlanOptions(gpus=["h200-141g"], price_per_gpu_hour=3.5, read_data=False,
                                                           measurement=Measurement("--tflops-per-gpu", 194.7, 989.0, 1)))
    [gpu] = cost["gpus"]
    assert {k: gpu[k] for k in plan["gpus"][0]["time"]} == plan["gpus"][0]["time"]
    assert cost["speed_source"] == plan["throughput"]["source"] == \
        "measured: --tflops-per-gpu, 195 TFLOP/s per GPU (19.7% MFU)"
    assert gpu["gpus"] == 8 and gpu["fits"] and gpu["cost"] == pytest.approx(gpu["gpu_hours"] * 3.5, rel=1e-5)
    [line] = cost_line(cost)
    assert line == (f"fine-tuning by {GLM5} on 8 x h200-141g: {gpu['wall_hours']:,.4g} h wall, "
                    f"{gpu['gpu_hours']:,.4g} GPU-hours, cost {gpu['cost']:,.2f}; speed: measured: --tflops-per-gpu, "
                    "195 TFLOP/s per GPU (19.7% MFU)")


@pytest.mark.parametrize("options, message", [
    (CostOptions(None, gpus=["h200-141g"]), "--gpu prices the training alternative of --recipe RECIPE; add --recipe"),
    (CostOptions(GLM5), "--recipe is priced from a measured speed: give --throughput"),
    (CostOptions(GLM5, "runs/x", 100.0), "--recipe is priced from a measured speed: give --throughput"),
    (CostOptions(GLM5, None, 100.0, price_per_gpu_hour=float("nan")), "--price-per-gpu-hour must be a finite number"),
    (CostOptions(GLM5, None, 5000.0), "--tflops-per-gpu 5000 is above the dense bf16 peak of h100-80g"),
    (CostOptions(GLM5, "runs/x", measured_gpu="h200-141g"), "--measured-gpu describes --tflops-per-gpu"),
    (CostOptions(GLM5, None, 100.0, gpus=["tpu"]), "--gpu 'tpu' unknown"),
])
def test_cost_options_that_would_not_take_effect_are_refused(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        options.check()
