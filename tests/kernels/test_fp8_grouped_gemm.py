"""The W8A16 grouped GEMM (`glmtune/kernels/fp8_grouped_gemm.py`): forward and input gradient
against the dequant path (`fp8_blocks.dequantize` + the per-expert loop) and a float64 sum of the
same operands, then `fp8_matmul.grouped_linear_fp8` with backend "triton" against "dequant" through
autograd, in Triton's CPU interpreter (child process); and the kernel compiled for sm_90 with every
autotuning config.

Cases: 4 experts owning 37, 0, 130 and 1 rows (an empty expert, row tiles that end mid-tile, more
tiles than rows of an expert), O 256 and I 384 (2 x 3 scale blocks), one dense group (E = 1); tiles
of 64 (each scale block split in four tiles: the scale index of a sub-tile) and of 128, the kernel's
two operand orders (SWAP). The weight's blocks have magnitudes 2^-6 .. 2^6 apart, so a scale applied
to the wrong block or the wrong expert is off by up to 2^12: `_check_scales_matter` shows that the
tolerances below reject exactly that mistake.

Tolerances (u = 2^-24, K the reduction width, S = sum_k |a_k w_k| per output element). The kernel's
operands are the dequant path's values (e4m3 -> fp32 times the block's scale, one rounding to the
activations' dtype), so the outputs differ only by the fp32 accumulation: for any order of the sums
(and of fused or separate products) a computed dot product is within gamma_K S = K u / (1 - K u) S of
the exact one (Higham, Accuracy and Stability, 3.1), so two fp32 results within 2 gamma_K S of each
other and of a float64 sum within gamma_K S. A bf16 output is then rounded once, to nearest: half a
unit is at most 2^-8 |y| (8 significant bits), so two bf16 results of fp32 sums within d of each
other are within d + 2^-7 |y| (and of the exact sum within d + 2^-8 |y|), times 1 + 2^-8 for the
rounded reference; 1.01 covers that.

Triton 3.9's interpreter multiplies bf16 `tl.dot` operands as their raw 16-bit patterns and rounds
fp32 to bf16 toward zero; the GPU multiplies the bf16 values and rounds to nearest even
(cvt.rn.bf16.f32). `_interpreter_as_the_gpu` makes the interpreter do what the GPU does, so that
bf16 runs here at all (the dequant kernel it also runs rounds the same way then). Run this file
under TRITON_INTERPRET=1 to print how much of each tolerance the differences use.
"""

import inspect

import pytest
import torch
from hopper_compile import H200_SHARED_MEMORY
from triton_interpreter import main, run_checks_in_interpreter

triton = pytest.importorskip("triton")

U32 = 2.0**-24
COUNTS = [37, 0, 130, 1]
OUT_DIM, IN_DIM = 256, 384
TILES = [{"SWAP": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64},
         {"SWAP": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}]


def _interpreter_as_the_gpu():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    cast, dot = builder.cast_impl, builder.create_dot

    def as_fp32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return ti.TensorHandle((h.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            nearest_even = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return ti.TensorHandle(nearest_even.astype(np.uint16), tl.bfloat16)  # finite values only here
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


def _weight(num_experts, out_dim, in_dim, seed):
    """(e4m3 [E, O, I], scales [E, O/128, I/128]) of a weight whose 128 x 128 blocks are 2^-6 .. 2^6 apart."""
    from glmtune.kernels import fp8_blocks

    gen = torch.Generator().manual_seed(seed)
    blocks = fp8_blocks.scale_shape((num_experts, out_dim, in_dim))
    magnitude = 2.0 ** torch.randint(-6, 7, blocks, generator=gen).float()
    magnitude = magnitude.repeat_interleave(128, -2)[..., :out_dim, :].repeat_interleave(128, -1)[..., :in_dim]
    return fp8_blocks.quantize_weight(torch.randn(num_experts, out_dim, in_dim, generator=gen) * magnitude)


def _rows(counts, width, dtype, seed):
    return torch.randn(sum(counts), width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _references(a, w, offsets):
    """(the dequant path's result, the float64 sum, S = sum |a w|) for rows a and the per-expert
    dequantized weight w [E, J, K] (forward: W; input gradient: W^T)."""
    from glmtune.kernels.grouped_gemm import grouped_linear

    exact = grouped_linear(a.double(), w.double(), offsets, "loop")
    magnitude = grouped_linear(a.double().abs(), w.double().abs(), offsets, "loop")
    return grouped_linear(a, w, offsets, "loop"), exact, magnitude


def _tolerances(magnitude, reference, exact, dtype, red_dim):
    """(against the dequant path, against the float64 sum): see the module docstring."""
    gamma = red_dim * U32 / (1 - red_dim * U32)
    if dtype == torch.float32:
        return 2 * gamma * magnitude, gamma * magnitude
    return (1.01 * (2 * gamma * magnitude + 2.0**-7 * reference.double().abs()),
            1.01 * (gamma * magnitude + 2.0**-8 * exact.abs()))


def _within(got, want, tolerance) -> bool:
    return bool(((got.double() - want.double()).abs() <= tolerance).all())


def _used(got, want, tolerance) -> float:
    """The largest difference as a fraction of its tolerance (printed: how close the bound is)."""
    return float(((got.double() - want.double()).abs() / tolerance).max())


def _check_products(counts, dtype, seed, report):
    """Forward and input gradient of one case against the dequant path and the float64 sum."""
    from glmtune.kernels import fp8_blocks
    from glmtune.kernels import fp8_grouped_gemm as fgg

    q, scale = _weight(len(counts), OUT_DIM, IN_DIM, seed)
    offsets = torch.cumsum(torch.tensor(counts), 0)
    w = fp8_blocks.dequantize(q, scale, dtype)
    x, dy = _rows(counts, IN_DIM, dtype, seed + 1), _rows(counts, OUT_DIM, dtype, seed + 2)
    got_y = fgg.fp8_grouped_linear(x, q, scale, offsets)
    for name, got, a, w_JK in (("forward", got_y, x, w),
                               ("input_grad", fgg.fp8_grouped_input_grad(dy, q, scale, offsets), dy, w.transpose(1, 2))):
        reference, exact, magnitude = _references(a, w_JK, offsets)
        assert got.dtype == dtype and got.shape == reference.shape
        to_reference, to_exact = _tolerances(magnitude, reference, exact, dtype, a.shape[1])
        assert _within(got, reference, to_reference), (name, dtype, _used(got, reference, to_reference))
        assert _within(got, exact, to_exact), (name, dtype, _used(got, exact, to_exact))
        report.append(f"#{name}:{str(dtype)[6:]}:used_ref={_used(got, reference, to_reference):.3f}"
                      f":used_f64={_used(got, exact, to_exact):.3f}"
                      f":max_abs_ref={float((got.double() - reference.double()).abs().max()):.3g}"
                      f":ulps_of_S_ref={float(((got.double() - reference.double()).abs() / (U32 * magnitude)).max()):.2f}")
    return q, scale, x, offsets, got_y


def _check_scales_matter(q, scale, x, offsets, y):
    """The forward with the scales of other blocks (along either dim) or of another expert differs
    from the kernel's by far more than the tolerance: the mistakes the checks above catch."""
    from glmtune.kernels import fp8_blocks

    for wrong in (scale.roll(1, -1), scale.roll(1, -2), scale.roll(1, 0)):
        reference, _, magnitude = _references(x, fp8_blocks.dequantize(q, wrong, x.dtype), offsets)
        assert not _within(y, reference, 100 * _tolerances(magnitude, reference, reference, x.dtype, x.shape[1])[0])


def check_kernel_matches_dequant_and_float64():
    """Tiles of 64 with SWAP in fp32 and bf16, tiles of 128 without it in bf16, a dense group."""
    from glmtune.kernels import fp8_grouped_gemm as fgg

    _interpreter_as_the_gpu()
    report = []
    fgg.INTERPRETER_CONFIG.update(TILES[0])
    _check_products(COUNTS, torch.float32, seed=0, report=report)
    _check_scales_matter(*_check_products(COUNTS, torch.bfloat16, seed=1, report=report))
    fgg.INTERPRETER_CONFIG.update(TILES[1])
    _check_products(COUNTS, torch.bfloat16, seed=2, report=report)
    _check_products([45], torch.bfloat16, seed=3, report=report)  # one group: a dense linear
    print(" ".join(report))  # the figures (run this file under TRITON_INTERPRET=1 to see them)


def _through_autograd(x, q, scale, offsets, backend, grad):
    from glmtune.kernels.fp8_matmul import grouped_linear_fp8

    x = x.clone().requires_grad_()
    y = grouped_linear_fp8(x, q, scale, offsets, backend)
    y.backward(grad)
    return y.detach(), x.grad


def _check_same_as_dequant(x, q, scale, offsets, grad):
    """Values and input gradient through autograd, backend triton against dequant."""
    from glmtune.kernels import fp8_blocks

    (y, dx), (y_ref, dx_ref) = (_through_autograd(x, q, scale, offsets, b, grad) for b in ("triton", "dequant"))
    w = fp8_blocks.dequantize(q, scale, x.dtype).to(x.device)
    for got, want, a, w_JK in ((y, y_ref, x, w), (dx, dx_ref, grad, w.transpose(1, 2))):
        _, exact, magnitude = _references(a.cpu(), w_JK.cpu(), offsets.cpu())
        tolerance = _tolerances(magnitude, want.cpu(), exact, x.dtype, a.shape[1])[0]
        assert _within(got.cpu(), want.cpu(), tolerance), (x.dtype, _used(got.cpu(), want.cpu(), tolerance))


def check_autograd_triton_matches_dequant():
    """grouped_linear_fp8 with backend triton: its values and input gradient equal dequant's within
    the tolerances above, both products through the kernel; widths that are not multiples of 128 fall
    back to dequant; the fake shapes match the real op (opcheck)."""
    from glmtune.kernels import fp8_grouped_gemm as fgg
    from glmtune.kernels import fp8_matmul

    _interpreter_as_the_gpu()
    fgg.INTERPRETER_CONFIG.update(TILES[0])
    calls = []
    for name in ("fp8_grouped_linear", "fp8_grouped_input_grad"):
        kernel = getattr(fgg, name)
        setattr(fgg, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    q, scale = _weight(len(COUNTS), OUT_DIM, IN_DIM, seed=3)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0)
    _check_same_as_dequant(_rows(COUNTS, IN_DIM, torch.bfloat16, seed=4), q, scale, offsets,
                           _rows(COUNTS, OUT_DIM, torch.bfloat16, seed=5))
    assert calls == ["fp8_grouped_linear", "fp8_grouped_input_grad"], calls
    x = _rows(COUNTS, IN_DIM, torch.bfloat16, seed=4)
    assert fp8_matmul.resolve_grouped_backend("auto", x, q) == "dequant"  # auto: the kernel on CUDA only
    assert fgg.fp8_grouped_linear(x[:0], q, scale, torch.zeros(4, dtype=torch.int64)).shape == (0, OUT_DIM)
    q_odd, _ = _weight(2, 136, 128, seed=5)  # 136 output rows: not a multiple of 128
    assert fp8_matmul.resolve_grouped_backend("triton", x, q_odd) == "dequant"
    small_q, small_scale = _weight(2, 128, 128, seed=6)
    args = (_rows([20], 128, torch.float32, seed=6), small_q, small_scale, torch.tensor([9, 20]), "triton")
    for op in (fp8_matmul._grouped_linear_fp8, fp8_matmul._grouped_linear_fp8_input_grad):
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration"))


if __name__ == "__main__":
    main(check_kernel_matches_dequant_and_float64, check_autograd_triton_matches_dequant)


def test_fp8_grouped_gemm_in_interpreter():
    printed = run_checks_in_interpreter(__file__)
    assert [word for word in printed if not word.startswith("#")] == ["check_kernel_matches_dequant_and_float64",
                                                                      "check_autograd_triton_matches_dequant"]


def test_backend_choice_off_the_gpu(monkeypatch):
    from glmtune.kernels import fp8_grouped_gemm as fgg
    from glmtune.kernels.fp8_matmul import grouped_linear_fp8, resolve_grouped_backend

    monkeypatch.setattr(fgg, "_interpreting", lambda: False)
    q, scale = _weight(2, 128, 128, seed=0)
    x = _rows([3, 2], 128, torch.float32, seed=1)
    assert resolve_grouped_backend("auto", x, q) == "dequant"
    with pytest.raises(ValueError, match="needs triton and a CUDA device"):
        resolve_grouped_backend("triton", x, q)
    with pytest.raises(ValueError, match="backend 'fast' unknown"):
        grouped_linear_fp8(x, q, scale, torch.tensor([3, 5]), "fast")


def _compile_for_hopper(config: dict, transposed: bool) -> str:
    """The kernel's PTX for sm_90, with the launcher's specialization of a real call: pointers and
    the widths 16-divisible (without it nothing is vectorized or pipelined); shared memory checked."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glmtune.kernels import fp8_grouped_gemm as fgg

    jitted = fgg._jit()
    names = list(inspect.signature(jitted.fn).parameters)
    constexprs = dict({k: v for k, v in config.items() if k not in fgg._LAUNCH_KEYS}, W_T=transposed,
                      PRECISION="tf32", E_POW2=32)
    pointers = {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "offsets_ptr": "*i64"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*bf16")
                 if name.endswith("_ptr") else "i32" for name in names}
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name in names
               if name.endswith("_ptr") or name in ("out_dim", "red_dim")}
    source = ASTSource(fn=jitted, signature=signature, attrs=aligned,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert 0 < compiled.metadata.shared <= H200_SHARED_MEMORY, (config, compiled.metadata.shared)
    return compiled.asm["ptx"]


def test_kernel_compiles_for_hopper_with_every_config():
    """Both directions with each autotuning config, bf16: the products are wgmma (Hopper's tensor
    cores), the loads pipelined into shared memory (cp.async), and the stages fit."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")
    from glmtune.kernels import fp8_grouped_gemm as fgg

    for config in fgg.CONFIGS:
        for transposed in (False, True):
            ptx = _compile_for_hopper(config, transposed)
            assert "wgmma.mma_async" in ptx and "cp.async" in ptx, (config, transposed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_matches_dequant_on_gpu():
    """Compiled and autotuned, bf16, 8 experts at GLM-5's down projection's widths (O 6144, I 2048)
    with uneven rows: backend triton within the tolerance above of dequant, through autograd."""
    counts = [300, 0, 17, 512, 129, 1, 64, 255]
    q, scale = (t.cuda() for t in _weight(len(counts), 6144, 2048, seed=0))
    offsets = torch.cumsum(torch.tensor(counts, device="cuda"), 0)
    _check_same_as_dequant(_rows(counts, 2048, torch.bfloat16, seed=1).cuda(), q, scale, offsets,
                           _rows(counts, 6144, torch.bfloat16, seed=2).cuda())
