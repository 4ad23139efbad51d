"""model.fp8_base: triton: refused where its kernels cannot run, before anything is built, by training
and by eval; and the plan leaves out the dequantized copy of the experts' weight the dequant backend makes."""

from __future__ import annotations

import pytest

from glmtune.config import load_config
from glmtune.config.validate import device_errors, fp8_base_errors
from glmtune.eval.placement import Placement
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.memory_model import moe_transients
from glmtune.plan.measure import planned_for
from glmtune.plan.memory import step_shape
from glmtune.plan.planner import degrees_for

RECIPE = "recipes/glm5/lora_fp8_1node.yaml"


def test_triton_fp8_base_is_refused_off_a_gpu():
    assert fp8_base_errors(load_config(RECIPE, ["--model.fp8_base", "triton", "--train.device", "cuda"])) == []
    assert fp8_base_errors(load_config(RECIPE, ["--model.fp8_base", "triton", "--train.device", "cpu"])) == [
        "model.fp8_base: triton runs Triton kernels on a CUDA GPU, not train.device: cpu; use dequant there"]
    auto = load_config(RECIPE, ["--model.fp8_base", "triton", "--train.device", "auto"])
    assert device_errors(auto, "cuda") == []
    assert device_errors(auto, "cpu") == ["model.fp8_base: triton runs Triton kernels on a CUDA GPU, and "
                                          "train.device: auto found none here (it runs on cpu); use dequant"]
    assert device_errors(load_config(RECIPE, ["--train.device", "auto"]), "cpu") == []  # the recipe's dequant


def test_eval_refuses_it_on_a_cpu():
    with pytest.raises(ValueError, match="--model.fp8_base triton runs Triton kernels on a CUDA GPU, and this "
                                         "evaluation runs on cpu: pass --model.fp8_base dequant"):
        Placement.choose("cpu", None, None, None, "triton")  # one process: no candidate read yet


def test_the_plan_has_no_dequantized_expert_weight_under_triton():
    dequant = load_config(RECIPE, [])
    triton = load_config(RECIPE, ["--model.fp8_base", "triton"])
    degrees = degrees_for(dequant)
    args = get_preset("glm5")
    assert "FP8 weight dequantized (largest projection)" in moe_transients(args, step_shape(dequant, degrees))
    assert "FP8 weight dequantized (largest projection)" not in moe_transients(args, step_shape(triton, degrees))
    assert planned_for(triton, degrees, 0).peak.total < planned_for(dequant, degrees, 0).peak.total
