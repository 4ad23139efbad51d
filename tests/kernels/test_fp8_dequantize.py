"""The one-pass FP8 dequantization kernel (`fp8_matmul.dequantize_fast`) against the torch
format reference bit for bit in fp32 (bf16: one rounding): partial blocks, stacked experts.
Runs in Triton's CPU interpreter in a child process."""

import pytest
import torch
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def check_kernel_equals_reference():
    from glmtune.kernels import fp8_blocks
    from glmtune.kernels.fp8_matmul import dequantize_fast

    gen = torch.Generator().manual_seed(0)
    for shape in ((256, 384), (200, 130), (3, 136, 256)):
        q, scale = fp8_blocks.quantize_weight(torch.randn(*shape, generator=gen))
        assert torch.equal(dequantize_fast(q, scale, torch.float32), fp8_blocks.dequantize(q, scale, torch.float32))
        # bf16: the same fp32 product rounded once (the interpreter's rounding to bf16 may land
        # one unit away from torch's round-to-nearest-even)
        torch.testing.assert_close(dequantize_fast(q, scale, torch.bfloat16),
                                   fp8_blocks.dequantize(q, scale, torch.bfloat16), rtol=2**-7, atol=0)


if __name__ == "__main__":
    main(check_kernel_equals_reference)


def test_dequantize_kernel_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_kernel_equals_reference"]
