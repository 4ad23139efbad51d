"""The RMSNorm kernels against the eager norm (`RMSNorm`, backend "torch"): forward, input and
weight gradients, in Triton's CPU interpreter (child process), in fp32 and in fp16; and both
kernels compiled for sm_90 at GLM-5's widths.

Half precision runs in fp16 here: the interpreter converts fp32 to bf16 by truncation (half of
1,024 random values came out one step low), not to nearest as the GPU does, while its fp16
conversion rounds to nearest; the kernels cast to the tensors' own dtypes, so fp16 checks that
each rounding sits where eager's does."""

import pytest
import torch
from hopper_compile import compile_for_hopper
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def _both(x, weight, dout, eps=1e-6):
    """((out, dx, dweight) eager, the same through the kernels) for one input."""
    from glmtune.models.common.rmsnorm import RMSNorm

    results = []
    for backend in ("torch", "triton"):
        norm = RMSNorm(x.shape[-1], eps).to(weight.dtype)
        norm.weight.data.copy_(weight)
        norm.backend = backend
        xi = x.detach().clone().requires_grad_()
        out = norm(xi)
        out.backward(dout)
        results.append((out.detach(), xi.grad, norm.weight.grad))
    return results


def _steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in representable steps between two 16-bit float tensors of the same signs."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def check_fp32_matches_eager():
    """fp32 throughout: only the order of the fp32 row sums differs."""
    from glmtune.kernels import rms_norm

    rms_norm.MAX_PROGRAMS = 3  # several rows per backward program, and a partial last block
    gen = torch.Generator().manual_seed(0)
    for rows, width in ((7, 48), (10, 200)):
        x = torch.randn(2, rows, width, generator=gen) * 3
        weight = torch.rand(width, generator=gen) + 0.5
        dout = torch.randn(2, rows, width, generator=gen)
        (out, dx, dw), (out_k, dx_k, dw_k) = _both(x, weight, dout)
        torch.testing.assert_close(out_k, out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx_k, dx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw_k, dw, rtol=1e-5, atol=1e-5)


def check_half_within_one_rounding_of_eager():
    """fp16 input and weight: the same roundings as eager, so outputs agree to one step where the fp32
    sums' order moves a value across a rounding boundary; a strided input (kv_a's latent slice) and an
    fp32 weight (the output then fp32) go through the same kernels."""
    from glmtune.kernels import rms_norm

    rms_norm.MAX_PROGRAMS = 4
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 9, 160, generator=gen).half()
    x = wide[..., :128]  # rows with a stride of 160
    weight = (torch.rand(128, generator=gen) + 0.5).half()
    dout = torch.randn(3, 9, 128, generator=gen).half()
    (out, dx, dw), (out_k, dx_k, dw_k) = _both(x, weight, dout)
    assert out_k.dtype == dx_k.dtype == dw_k.dtype == torch.float16
    assert _steps(out_k, out) <= 1 and (out_k == out).float().mean() > 0.95
    assert _steps(dx_k, dx) <= 1 and (dx_k == dx).float().mean() > 0.9
    assert _steps(dw_k, dw) <= 1  # 27 rows summed in fp32 in another order, one rounding
    (out, dx, dw), (out_k, dx_k, dw_k) = _both(x, weight.float(), dout.float())
    assert out_k.dtype == torch.float32 and dx_k.dtype == torch.float16 and dw_k.dtype == torch.float32
    torch.testing.assert_close(out_k, out, rtol=1e-6, atol=1e-6)
    assert _steps(dx_k, dx) <= 1
    torch.testing.assert_close(dw_k, dw, rtol=1e-5, atol=1e-5)


def check_custom_ops_pass_opcheck():
    """The ops' schemas, fake (meta) functions and autograd registration, as torch.compile uses them."""
    from glmtune.kernels import rms_norm

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=gen, requires_grad=True)
    weight = (torch.rand(40, generator=gen) + 0.5).requires_grad_()
    torch.library.opcheck(rms_norm._rms_norm, (x, weight, 1e-6))
    out, rstd = rms_norm._rms_norm(x.detach(), weight.detach(), 1e-6)
    torch.library.opcheck(rms_norm._rms_norm_backward, (torch.randn_like(out), x.detach(), weight.detach(), rstd))


def test_rms_norm_in_interpreter():
    assert run_checks_in_interpreter(__file__) == [
        "check_fp32_matches_eager", "check_half_within_one_rounding_of_eager", "check_custom_ops_pass_opcheck"]


def test_kernels_compile_for_hopper_at_glm5_widths():
    """GLM-5's norms: hidden 6144, q_a 2048, kv_a 512 (bf16 in and out, fp32 1/rms and partials)."""
    from glmtune.kernels import rms_norm

    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")
    pointers = {"rstd_ptr": "*fp32", "dw_ptr": "*fp32"}
    config = {"num_warps": 8, "num_stages": 1}
    for width in (6144, 2048, 512):
        block = {"BLOCK": rms_norm._block(width)}
        compile_for_hopper(rms_norm._kernel(rms_norm._forward_kernel), block, config, pointers)
        compile_for_hopper(rms_norm._kernel(rms_norm._backward_kernel), block, config, pointers)


if __name__ == "__main__":
    main(check_fp32_matches_eager, check_half_within_one_rounding_of_eager, check_custom_ops_pass_opcheck)
