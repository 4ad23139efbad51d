"""model.norm_backend: the Triton RMSNorm is refused where it cannot run, before anything is built,
and the plan counts what it keeps instead of the eager norm's fp32 copy."""

from __future__ import annotations

from glmtune.config import load_config
from glmtune.config.validate import device_errors, norm_backend_errors
from glmtune.models.common.memory_model import StepShape
from glmtune.models.glm5.memory_activations import norm_saved
from glmtune.plan.memory import step_shape
from glmtune.plan.measure import planned_for
from glmtune.plan.planner import degrees_for

RECIPE = "recipes/glm5/sft_4k.yaml"


def test_triton_norms_are_refused_on_a_cpu():
    assert norm_backend_errors(load_config(RECIPE, ["--model.norm_backend", "triton", "--train.device", "cuda"])) == []
    assert norm_backend_errors(load_config(RECIPE, ["--model.norm_backend", "triton", "--train.device", "cpu"])) == [
        "model.norm_backend: triton runs Triton kernels on a CUDA GPU, not train.device: cpu; use torch there"]
    auto = load_config(RECIPE, ["--model.norm_backend", "triton", "--train.device", "auto"])
    assert device_errors(auto, "cuda") == []
    assert device_errors(auto, "cpu") == ["model.norm_backend: triton runs Triton kernels on a CUDA GPU, and "
                                          "train.device: auto found none here (it runs on cpu); use torch"]
    # auto, the default, is the kernels on a GPU and eager elsewhere: never refused
    assert norm_backend_errors(load_config(RECIPE, ["--train.device", "cpu"])) == []
    assert device_errors(load_config(RECIPE, ["--train.device", "auto"]), "cpu") == []


def test_the_plan_counts_the_fused_norms_input_and_rms_instead_of_an_fp32_copy():
    """Per norm of width w over q rows: eager keeps 4 q w + 4 q (+ 2 q w when its weight trains), the
    kernels 2 q w + 4 q; the rank's layers differ by that sum over their norms."""
    q, w = 4096, 6144
    assert norm_saved(q, w, 2, weight_trains=True) - norm_saved(q, w, 2, True, fused=True) == 4 * q * w
    assert norm_saved(q, w, 2, weight_trains=False) - norm_saved(q, w, 2, False, fused=True) == 2 * q * w
    torch_cfg = load_config(RECIPE, ["--parallel.activation_checkpointing", "none", "--model.norm_backend", "torch"])
    triton_cfg = load_config(RECIPE, ["--parallel.activation_checkpointing", "none", "--model.norm_backend", "triton"])
    degrees = degrees_for(torch_cfg)
    assert not step_shape(torch_cfg, degrees).fused_norms and step_shape(triton_cfg, degrees).fused_norms
    assert StepShape(1, 8).fused_norms is False
    # auto (the default) plans the kernels for a job on a GPU, eager for one on the CPU
    assert step_shape(load_config(RECIPE, []), degrees).fused_norms
    assert not step_shape(load_config(RECIPE, ["--train.device", "cpu"]), degrees).fused_norms
    eager = planned_for(torch_cfg, degrees, 192).peak.total
    fused = planned_for(triton_cfg, degrees_for(triton_cfg), 192).peak.total
    assert fused < eager
