"""The masked flash-attention kernels against a float64 softmax reference (output, lse,
q/k/v gradients) and, inside the model, the "triton" attention backend against "eager"
(logits and every gradient, one-document and packed rows) — in Triton's CPU interpreter
(child process; fp16 and fp32, the interpreter has no bf16). 16 x 16 tiles so that a
short row spans many tiles: partial tiles, empty tiles skipped, causal tile bounds."""

import pytest
import torch
from hopper_compile import H200_SHARED_MEMORY, compile_for_hopper
from triton_interpreter import main, run_checks_in_interpreter

triton = pytest.importorskip("triton")


def _small_tiles():
    from glmtune.kernels import sparse_attention as sa

    for config in (sa.FORWARD_CONFIG, sa.DQ_CONFIG, sa.DK_CONFIG, sa.DV_CONFIG):
        config.update(BLOCK_M=16, BLOCK_N=16)
    return sa


def _reference(q, k, v, allowed, scale):
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no key attends nothing
    return probs @ v.double(), logits.logsumexp(-1)


def check_kernels_match_float64_reference():
    """Tail queries (37 of 70 keys) with 16 x 16 tiles, then a whole packed row (48 queries =
    48 keys) with the dK / dV kernels on 16 x 32 tiles (their grid runs over key tiles); then
    with dQ and / or dV from the dS and P the dK launch materializes."""
    sa = _small_tiles()
    _compare_with_reference(sa, seed=0, queries=37, keys=70, buffers=(0, 0))  # the dQ and dV kernels
    for config in (sa.DK_CONFIG, sa.DV_CONFIG):
        config.update(BLOCK_N=32)
    _compare_with_reference(sa, seed=1, queries=48, keys=48, buffers=(0, 0))
    fits = 2 * 3 * 37 * 70 * 2  # [B, N, S, T] fp16 bytes of the tail case (each buffer's size)
    _compare_with_reference(sa, seed=2, queries=37, keys=70, buffers=(fits, fits - 1))  # dQ = dS K, one GEMM
    _compare_with_reference(sa, seed=3, queries=48, keys=48, buffers=(1 << 30, 1 << 30))  # and dV = P^T dO
    _compare_with_reference(sa, seed=4, queries=37, keys=70, buffers=(fits - 1, fits))  # dV alone


def _compare_with_reference(sa, seed, queries, keys, buffers):
    g = torch.Generator().manual_seed(seed)
    b, n, s, t, kd, vd = 2, 3, queries, keys, 64, 32
    dtype = torch.float16
    q_all = torch.randn(b, n, t, kd, generator=g).to(dtype)
    q = q_all[:, :, t - s:].requires_grad_()  # the tail queries: a strided view, as the model passes it
    k = torch.randn(b, n, t, kd, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(b, t, n, 2 * vd, generator=g).to(dtype)
    v = kv.transpose(1, 2)[..., vd:].requires_grad_()  # a head-split view: strided, last dim contiguous
    causal = torch.ones(s, t, dtype=torch.bool).tril(t - s)
    allowed = (torch.rand(b, s, t + 5, generator=g) < 0.6)[:, :, 3:3 + t] & causal  # a strided mask slice
    allowed[0, 5] = False  # a query with no allowed key
    allowed[1, :20, 16:48] = False  # whole tiles with no allowed key: skipped
    allowed[..., t - 4:] = False
    scale = kd**-0.5
    out, lse = sa.sparse_attention_forward(q, k, v, allowed, scale)
    ref_out, ref_lse = _reference(q, k, v, allowed, scale)
    assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5])) and not out.isnan().any()
    assert (out.double() - ref_out).abs().max() < 2e-3
    live = allowed.any(-1).unsqueeze(1).expand_as(lse)
    assert (lse[live].double() - ref_lse[live]).abs().max() < 1e-5 and (lse[~live] == float("inf")).all()
    grad = torch.randn(b, n, s, vd, generator=g).to(dtype)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    grads = sa.sparse_attention_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, allowed, scale, *buffers)
    for mine, theirs in zip(grads, ref_grads):
        assert mine.shape == theirs.shape and mine.is_contiguous()
        assert (mine.double() - theirs).abs().max() < 3e-3 * max(1.0, theirs.abs().max().item())
    assert (grads[1][:, :, t - 4:] == 0).all() and (grads[2][:, :, t - 4:] == 0).all()  # keys nobody sees


def check_ops_registration_is_consistent():
    """The custom ops' fake (meta) kernels give the real outputs' shapes and strides with the
    strided views the model passes (torch.compile trusts them)."""
    sa = _small_tiles()
    from glmtune.models.glm5 import triton_attention as ta

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 2, 32, generator=g).transpose(1, 2)[:, :, 4:]  # [1, 2, 8, 32], strided
    kv = torch.randn(1, 12, 2, 48, generator=g).transpose(1, 2)
    k, v = kv[..., :32], kv[..., 32:]
    allowed = torch.ones(8, 12, dtype=torch.bool).tril(4).unsqueeze(0)
    out, lse = sa.sparse_attention_forward(q, k, v, allowed, 0.2)
    for buffer_bytes in (0, 1 << 30):  # dQ and dV from their kernels, then from materialized dS and P
        torch.library.opcheck(ta.sparse_attention, (q, k, v, allowed, 0.2, buffer_bytes))
        torch.library.opcheck(ta.sparse_attention_grads,
                              (torch.randn_like(out), q, k, v, out, lse, allowed, 0.2, buffer_bytes))


def check_model_backend_matches_eager():
    _small_tiles()
    from glmtune.models.glm5.attention import set_attention_score_buffer
    from tests.models.test_attention_backends import assert_backend_matches_eager

    for packed in (False, True):
        assert_backend_matches_eager("triton", packed)  # the default bound: dS and P materialized
        assert_backend_matches_eager("triton", packed, lambda model: set_attention_score_buffer(model, 0))


@pytest.mark.parametrize("rows, keys, offset", [(64, 128, 0), (60, 128, 8), (64, 130, 0), (128, 256, 3)])
def test_tile_flags_mark_exactly_the_tiles_with_an_allowed_key(rows, keys, offset):
    """Aligned masks take the int64-word reduction, the others (offset 3, ragged sizes) bytes."""
    from glmtune.kernels.sparse_attention import tile_flags

    full = torch.rand(2, rows + 8, keys + 8, generator=torch.Generator().manual_seed(rows + keys)) < 0.002
    mask = full[:, offset:offset + rows, :keys]
    for block_m, block_n in ((16, 16), (16, 32), (8, 64)):
        expected = torch.zeros(2, -(-rows // block_m), -(-keys // block_n), dtype=torch.bool)
        for i in range(expected.shape[1]):
            for j in range(expected.shape[2]):
                tile = mask[:, i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
                expected[:, i, j] = tile.flatten(1).any(1)
        flags = tile_flags(mask, block_m, block_n)
        assert flags.dtype == torch.uint8 and torch.equal(flags.bool(), expected)
        assert 0 < expected.sum() < expected.numel()


def _compile_for_hopper(fn, constexprs: dict, config: dict) -> int:
    from glmtune.kernels import sparse_attention as sa

    pointer_types = {"mask_ptr": "*u8", "flags_ptr": "*u8", "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
    return compile_for_hopper(sa._kernel(fn), constexprs, config, pointer_types)


def test_kernels_compile_for_hopper_at_glm5_widths():
    """Every kernel and launch variant at qk 256 / v 256 with the configured tiles."""
    from glmtune.kernels import sparse_attention as sa

    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")
    widths = dict(HEAD_K=256, HEAD_V=256, K_PAD=256, V_PAD=256)
    dkv = sa._sparse_attention_dkv_kernel
    launches = [(sa._sparse_attention_forward_kernel, sa.FORWARD_CONFIG, {}),
                (sa._sparse_attention_dq_kernel, sa.DQ_CONFIG, {}),
                (dkv, sa.DK_CONFIG, dict(GRAD_K=True, STORE_DS=False, STORE_P=False, FROM_ZERO=0)),
                (dkv, sa.DV_CONFIG, dict(GRAD_K=False, STORE_DS=False, STORE_P=False, FROM_ZERO=0)),
                (dkv, sa.DK_CONFIG, dict(GRAD_K=True, STORE_DS=True, STORE_P=True, FROM_ZERO=1))]
    for fn, config, extra in launches:
        constexprs = dict(widths, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], **extra)
        assert 0 < _compile_for_hopper(fn, constexprs, config) <= H200_SHARED_MEMORY, (fn.__name__, extra)
    delta = dict(HEAD_V=256, V_PAD=256, BLOCK_M=64)
    assert _compile_for_hopper(sa._attention_delta_kernel, delta, {"num_warps": 4, "num_stages": 1}) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_k,head_v", [(48, 32), (192, 128), (256, 256)])
def test_kernels_on_gpu_match_float64_reference(head_k, head_v):
    """Compiled for the GPU (not the interpreter), bf16, the configured tiles, the model's
    strided views: the tiny preset's 48 / 32 head dims (which Triton 3.6 got wrong when padded
    to 32 only), GLM-5's 192 / 128 (qk_nope + rope / v) and the proxy's 256 / 256."""
    from glmtune.kernels import sparse_attention as sa

    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, s, t = 2, 4, 256, 512
    q = torch.randn(b, t, n, head_k, generator=g, device="cuda").bfloat16().transpose(1, 2)[:, :, t - s:]
    kv = torch.randn(b, t, n, head_k + head_v, generator=g, device="cuda").bfloat16().transpose(1, 2)
    k, v = kv[..., :head_k], kv[..., head_k:]
    causal = torch.ones(s, t, dtype=torch.bool, device="cuda").tril(t - s)
    allowed = (torch.rand(b, s, t, generator=g, device="cuda") < 0.5) & causal
    allowed[:, :, 0] = True
    scale = head_k**-0.5
    out, lse = sa.sparse_attention_forward(q, k, v, allowed, scale)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = _reference(*leaves, allowed, scale)
    assert (out.double() - ref_out).abs().max() < 2e-2
    grad = torch.randn(out.shape, generator=g, device="cuda").bfloat16()
    ref_grads = torch.autograd.grad(ref_out, leaves, grad.double())
    for buffers in ((0, 0), (1 << 30, 1 << 30)):
        grads = sa.sparse_attention_backward(grad, q, k, v, out, lse, allowed, scale, *buffers)
        for mine, theirs in zip(grads, ref_grads):
            assert (mine.double() - theirs).abs().max() < 3e-2 * max(1.0, theirs.abs().max().item()), buffers


def test_sparse_attention_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_kernels_match_float64_reference",
                                                   "check_ops_registration_is_consistent",
                                                   "check_model_backend_matches_eager"]


if __name__ == "__main__":
    main(check_kernels_match_float64_reference, check_ops_registration_is_consistent, check_model_backend_matches_eager)
