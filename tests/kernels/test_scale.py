"""The in-place scale kernel against `mul_`, in Triton's CPU interpreter (child process)."""

import pytest
import torch
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def check_scale_matches_mul():
    from glmtune.kernels import scale

    for numel, factor in ((scale.BLOCK * 2 + 7, 0.37), (5, -2.0), (0, 3.0)):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        expected = x * factor
        assert scale.scale_(x, torch.tensor(factor)) is x
        assert torch.equal(x, expected)
    x = torch.randn(100)
    before = x.clone()
    scale.scale_(x, torch.tensor(1.0))
    assert torch.equal(x, before)


def test_scale_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_scale_matches_mul"]


if __name__ == "__main__":
    main(check_scale_matches_mul)
