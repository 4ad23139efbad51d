"""`model.fp8_base: triton`: a LoRA model on a frozen FP8 base whose products read the e4m3 weights
in the W8A16 kernel (`glmtune/kernels/fp8_grouped_gemm.py`) computes what the dequant backend
computes, in Triton's CPU interpreter (a child process: tests/kernels/triton_interpreter.py).

The tiny GLM-5 with 128-wide expert and dense MLP widths, so that the routed experts (both
projections), the shared experts, the dense MLPs and o_proj take the kernel, and the MLA's narrower
projections (q_a 128 -> 64, ...) fall back to dequant as `fp8_matmul` says; fp32, so the two
backends' products have the same operands and differ only in the order of the fp32 sums. Those
differences, a few units of 2^-24 of each sum, grow through the layers' backward (the attention's
softmax among them): measured, every adapter gradient within 2.2e-5 of its largest element (the
loss equal to the last digit printed). A gradient is held to 2e-4 of its largest element, an
element-wise bound would fail on the small elements whose sums cancel. The kernel's own bounds are
tests/kernels/test_fp8_grouped_gemm.py's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

# 128-multiples where the kernel can take them (module docstring).
WIDTHS = dict(moe_intermediate_size=128)


def _lora_step(backend: str):
    """(loss, adapter gradients) of one LoRA step of the tiny model on an FP8 base under `backend`."""
    import torch

    from glmtune.config.schema import PeftConfig
    from glmtune.models.common.microbatch import MicroBatch
    from glmtune.models.glm5.args import get_preset
    from glmtune.models.glm5.fp8_base import convert_to_fp8_base
    from glmtune.models.glm5.model import build_model
    from glmtune.peft import apply_lora

    model = build_model(get_preset("tiny").replace(**WIDTHS), torch.float32, seed=0)
    convert_to_fp8_base(model, backend)
    apply_lora(model, PeftConfig(method="lora", rank=4), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # B is zero at init: give every update a path to the loss
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(1))
    out = model(x, MicroBatch(x, targets=torch.roll(x, -1, 1)))
    (out.loss_sum / out.num_targets).backward()
    return out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_triton_base_equals_dequant():
    """Loss and every adapter gradient of the two backends; the kernel ran forward and backward,
    for stacked experts and for dense layers."""
    import torch

    from glmtune.kernels import fp8_grouped_gemm as fgg

    calls: list[tuple[str, int]] = []
    for name in ("fp8_grouped_linear", "fp8_grouped_input_grad"):
        kernel = getattr(fgg, name)
        setattr(fgg, name, lambda *a, kernel=kernel, name=name: calls.append((name, a[1].shape[0])) or kernel(*a))
    loss, grads = _lora_step("triton")
    assert {name for name, _ in calls} == {"fp8_grouped_linear", "fp8_grouped_input_grad"}, calls
    assert {experts for _, experts in calls} == {1, 8}, calls  # dense layers (one group) and the routed experts
    calls.clear()
    want_loss, want_grads = _lora_step("dequant")
    assert not calls  # the reference never touched the kernel
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        assert ".lora_" in name and grad.abs().sum() > 0, name
        assert (grad - want_grads[name]).abs().max() <= 2e-4 * want_grads[name].abs().max(), name


if __name__ == "__main__":
    from tests.kernels.triton_interpreter import main

    main(check_triton_base_equals_dequant)


def test_triton_fp8_base_equals_dequant_in_interpreter():
    from tests.kernels.triton_interpreter import run_checks_in_interpreter

    assert run_checks_in_interpreter(__file__) == ["check_triton_base_equals_dequant"]
