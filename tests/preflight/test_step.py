"""Checks 5 and 6 on real reference runs with faults planted through real hooks: a NaN gradient, a
path whose gradient is zeroed, and data that leaves nothing to train on."""

from __future__ import annotations

import torch

from glmtune.preflight.runs import run_reference
from glmtune.preflight.step import check_gradients, check_step
from tests.preflight.conftest import SFT

EXPERTS = "model.layers.2.mlp.experts.gate_up_proj"


def test_passing_run_records_its_step(sft_done):
    evidence = sft_done.check(5)["evidence"]
    assert evidence["step_1"]["supervised_tokens"] > 0 and evidence["data"]["train_conversations"] == 64
    assert evidence["updated_tensors"]["moved"] == evidence["updated_tensors"]["with_gradient"] > 0


def test_nan_gradient_fails_both_and_names_the_path(fresh):
    pf = fresh()

    def plant(model):
        model.get_parameter(EXPERTS).register_hook(lambda grad: torch.full_like(grad, float("nan")))

    ref = run_reference(pf, on_model=plant)
    step, gradients = check_step(pf, ref), check_gradients(pf, ref)
    assert step.status == "fail" and "gradient norm is nan at step 1" in step.message
    assert gradients.status == "fail"
    assert gradients.message.startswith(f"routed_experts: gradient norm nan at step 1 ({EXPERTS})")
    assert gradients.evidence["paths"]["attention"]["state"] == "finite, non-zero"  # the others are fine


def test_zero_gradient_on_a_trainable_path_fails(fresh):
    pf = fresh()

    def plant(model):
        for name, param in model.named_parameters():
            if ".mlp.experts." in name and param.requires_grad:  # the MTP layer's are frozen
                param.register_hook(torch.zeros_like)

    ref = run_reference(pf, on_model=plant)
    assert check_step(pf, ref).status == "pass"  # the step ran; what has a gradient moved
    result = check_gradients(pf, ref)
    assert result.status == "fail"
    assert result.message.startswith("routed_experts: gradient norm 0 at step 1 on a trainable path")


def test_data_with_nothing_to_train_on_fails_the_step(fresh):
    pf = fresh(SFT, "--data.packed_sequence_size", "64")
    ref = run_reference(pf)
    result = check_step(pf, ref)
    assert result.status == "fail" and "nothing left to train on" in result.message
    assert check_gradients(pf, ref).status == "skip"


def test_a_bf16_run_with_fp32_masters_counts_the_update_its_masters_hold(fresh):
    # At the tiny recipe's lr a norm weight of 1.0 does not change in bf16 (its step is 2^-8 away) while its
    # fp32 master moves: the update is held, and the step passes (it failed on the GPU before the masters counted).
    pf = fresh(SFT, "--model.dtype", "bfloat16", "--train.master_weights", "fp32")
    ref = run_reference(pf)
    result = check_step(pf, ref)
    assert result.status == "pass", result.message
    moved = result.evidence["updated_tensors"]
    assert moved["moved"] == moved["with_gradient"] > 0
    norm = "model.layers.0.input_layernorm.weight"
    assert ref.moved[norm]
