"""The fused sparse-MLA kernels (`glmtune.kernels.sparse_mla`) against a float64 softmax over the
gathered keys (output, lse, dq, dc) and against the pure-torch absorbed op they replace, then the
"absorbed_triton" backend inside an MLA layer against "absorbed" — in Triton's CPU interpreter
(child process; fp16 and fp32, the interpreter has no bf16). Small tiles (16 slots, 16 columns)
so that a query's slots span several tiles, the latent's last column tile and the rope's one are
partial (R 40, E 8), and the backward's buffers hold two queries (several chunks). The keys' latent
and rope parts are strided views of one tensor whose batch rows are not T rows apart. The Hopper compile
test builds every kernel at GLM-5's widths (64 heads, R 512, E 64) for sm_90 with ptxas.

Tolerances. fp32: the kernels and the reference sum the same terms in different orders, and the
dc atomics in a run-dependent order: each exact to fp32's 2^-24 times a few dozen terms, so 1e-5
of the tensor's largest value. fp16 (unit roundoff 2^-11 ~ 5e-4): the inputs are the same fp16
values; P and dS are rounded to fp16 before their products (as flash rounds them) and the
outputs once: a few units of 2^-11 relative, so 4e-3 of the largest value."""

import pytest
import torch
from hopper_compile import H200_SHARED_MEMORY, compile_for_hopper
from triton_interpreter import main, run_checks_in_interpreter

triton = pytest.importorskip("triton")


def _small_tiles():
    from glmtune.kernels import sparse_mla as sm

    sm.FORWARD_CONFIG.update(BLOCK_H=16, BLOCK_N=16)
    sm.DQ_CONFIG.update(BLOCK_H=16, BLOCK_N=16)
    sm.DKV_CONFIG.update(BLOCK_N=16, BLOCK_C=16)
    sm.SELECT_BLOCK = 16
    return sm


def _case(seed: int, dtype, batch=2, queries=9, keys=40, heads=3, latent=40, rope=8, slots=37):
    """q [M, N, C], c [B x T, C], index [M, K] (distinct keys per query, none of each row's last 3),
    valid [M, K] with holes, a query with no valid slot and one whose valid slots end early."""
    g = torch.Generator().manual_seed(seed)
    rows, width = batch * queries, latent + rope
    q = torch.randn(rows, heads, width, generator=g).to(dtype)
    c = torch.randn(batch * keys, width, generator=g).to(dtype)
    index = torch.stack([torch.randperm(keys - 3, generator=g)[:slots] for _ in range(rows)])  # 3 keys unselected
    valid = torch.rand(rows, slots, generator=g) < 0.8
    valid[3] = False
    valid[5, 20:] = False
    return q, c, index, valid, queries, keys, width**-0.5, latent


def _head_major(x_MNX):
    """x's values laid out [N, M, X], as an einsum over the heads returns them."""
    return x_MNX.transpose(0, 1).contiguous().transpose(0, 1)


def _parts(q, c, keys, latent):
    """The kernels' operands, strided as the layer hands them over: q's latent head-major, its rope
    part a view of q; c's parts views of one [B, T + 2, C] tensor (rows C apart, batch rows
    (T + 2) x C apart, as a context-parallel gather's halves)."""
    batch = c.shape[0] // keys
    padded = torch.cat([c.view(batch, keys, -1), c.new_zeros(batch, 2, c.shape[-1])], dim=1)[:, :keys]
    return (_head_major(q[..., :latent]), q[..., latent:], padded[..., :latent], padded[..., latent:])


def _forward(sm, q, c, index, valid, queries, keys, scale, latent):
    return sm.sparse_mla_forward(*_parts(q, c, keys, latent), index, valid, queries, scale)


def _backward(sm, grad, q, c, index, valid, out, lse, queries, keys, scale, *buffer_bytes):
    """(dq [M, N, C], dc [B x T, C]): the kernels' parts put together (the latent is out's width)."""
    parts = _parts(q, c, keys, out.shape[-1])
    dq_lat, dq_rot, dc_lat, dc_rot = sm.sparse_mla_backward(_head_major(grad), *parts, index, valid, out, lse,
                                                            queries, scale, *buffer_bytes)
    return torch.cat([dq_lat, dq_rot], -1), torch.cat([dc_lat, dc_rot], -1).view(c.shape)


def _float64_reference(q, c, index, valid, queries, keys, scale, latent):
    """(out, lse) in float64 from leaves q and c: softmax over each query's gathered valid keys."""
    rows = torch.arange(q.shape[0], device=q.device).unsqueeze(-1)
    keys_MKC = c[(rows // queries) * keys + index]
    logits = torch.einsum("mnc,mkc->mnk", q, keys_MKC) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("mnk,mkr->mnr", probs, keys_MKC[..., :latent]), logits.logsumexp(-1)


def _close(mine, theirs, tol):
    assert mine.shape == theirs.shape
    err = (mine.double() - theirs.double()).abs().max().item()
    assert err <= tol * max(1.0, theirs.double().abs().max().item()), err


def check_kernels_match_float64_reference():
    sm = _small_tiles()
    for seed, dtype, tol in ((0, torch.float32, 1e-5), (1, torch.float16, 4e-3)):
        q, c, index, valid, queries, keys, scale, latent = _case(seed, dtype)
        out, lse = _forward(sm, q, c, index, valid, queries, keys, scale, latent)
        leaves = [x.double().requires_grad_() for x in (q, c)]
        ref_out, ref_lse = _float64_reference(leaves[0], leaves[1], index, valid, queries, keys, scale, latent)
        _close(out, ref_out, tol)
        assert (out[3] == 0).all() and (lse[3] == float("-inf")).all()
        live = valid.any(-1)
        _close(lse[live], ref_lse[live], tol)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 10)).to(dtype)
        ref_dq, ref_dc = torch.autograd.grad(ref_out, leaves, grad.double())
        for buffer_bytes in (1 << 30, 2 * q.shape[1] * index.shape[1] * q.element_size()):  # one chunk; 2 queries each
            dq, dc = _backward(sm, grad, q, c, index, valid, out, lse, queries, keys, scale, buffer_bytes)
            assert dq.dtype == q.dtype and dc.dtype == c.dtype
            _close(dq, ref_dq, tol)
            _close(dc, ref_dc, tol)
        unseen = torch.ones(c.shape[0], dtype=torch.bool)
        unseen[((torch.arange(q.shape[0]).unsqueeze(-1) // queries) * keys + index)[valid]] = False
        assert unseen.any() and (dc[unseen] == 0).all()  # keys no query selected: no gradient


def check_kernels_match_the_torch_op():
    """The same inputs through `absorbed_attention`'s pure-torch blocks (fp32: 1e-5)."""
    sm = _small_tiles()
    from glmtune.models.glm5 import absorbed_attention as aa

    q, c, index, valid, queries, keys, scale, latent = _case(2, torch.float32)
    batch = c.shape[0] // keys
    shaped = (q.view(batch, queries, *q.shape[1:]), c.view(batch, keys, -1), index.view(batch, queries, -1),
              valid.view(batch, queries, -1))
    ref_out, ref_lse = aa.absorbed_attention(*shaped, scale, latent)
    out, lse = _forward(sm, q, c, index, valid, queries, keys, scale, latent)
    _close(out, ref_out.view(out.shape), 1e-5)
    live = valid.any(-1)
    _close(lse[live], ref_lse.view(lse.shape)[live], 1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    ref_dq, ref_dc = aa.absorbed_attention_backward(grad.view(ref_out.shape), *shaped, ref_out, ref_lse, scale,
                                                    latent)
    dq, dc = _backward(sm, grad, q, c, index, valid, out, lse, queries, keys, scale)
    _close(dq, ref_dq.view(dq.shape), 1e-5)
    _close(dc, ref_dc.view(dc.shape), 1e-5)


def check_selected_keys_match_the_torch_op():
    """The one-pass index kernel against the torch op (its reference), exactly: a strided mask slice
    over several 16-key tiles, a query with no key, one with exactly K keys, one with fewer."""
    sm = _small_tiles()
    from glmtune.models.glm5 import absorbed_attention as aa

    slots = 9
    full = torch.rand(2, 7, 60, generator=torch.Generator().manual_seed(4)) < 0.1
    full[0, 1] = False
    full[0, 2, :] = False
    full[0, 2, torch.arange(3, 60, 6)[:slots]] = True
    full[1, 4, :50] = torch.arange(50) % 7 == 0
    mask = full[:, :, 2:55]  # a slice: rows strided by 60
    assert int(mask.sum(-1).max()) <= slots and int(mask.sum(-1)[0, 2]) == slots
    index, valid = sm.selected_keys(mask, slots)
    want_index, want_valid = aa.selected_keys(mask, slots)
    assert torch.equal(index, want_index) and torch.equal(valid, want_valid)


def check_model_backend_matches_absorbed():
    _small_tiles()
    from tests.models.test_absorbed_attention import assert_fused_backend_matches_absorbed

    for case in ("one_document", "packed", "short", "cp"):
        assert_fused_backend_matches_absorbed(case)


POINTER_TYPES = {"index_ptr": "*i64", "valid_ptr": "*u8", "ends_ptr": "*i32", "lse_ptr": "*fp32",
                 "delta_ptr": "*fp32", "dc_lat_ptr": "*fp32", "dc_rot_ptr": "*fp32", "mask_ptr": "*u8",
                 "count_ptr": "*i32"}


def _compile_for_hopper(fn, constexprs: dict, config: dict) -> int:
    from glmtune.kernels import sparse_mla as sm

    return compile_for_hopper(sm._kernel(fn), constexprs, config, POINTER_TYPES)


def test_kernels_compile_for_hopper_at_glm5_widths():
    """Every kernel with the configured tiles at GLM-5's widths: 64 heads, latent 512, rope 64."""
    from glmtune.kernels import sparse_mla as sm

    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")
    widths = dict(R=512, E=64)
    launches = [(sm._sparse_mla_forward_kernel, sm.FORWARD_CONFIG, dict(R_PAD=512, E_PAD=64)),
                (sm._sparse_mla_dq_kernel, sm.DQ_CONFIG, dict(R_PAD=512, E_PAD=64)),
                (sm._sparse_mla_dkv_kernel, sm.DKV_CONFIG, dict(N_PAD=64, BLOCK_C=sm.DKV_CONFIG["BLOCK_C"]))]
    for fn, config, extra in launches:
        tiles = {key: config[key] for key in ("BLOCK_H", "BLOCK_N") if key in config}
        assert 0 < _compile_for_hopper(fn, dict(widths, **tiles, **extra), config) <= H200_SHARED_MEMORY, fn.__name__
    select = dict(BLOCK_T=sm.SELECT_BLOCK)
    assert _compile_for_hopper(sm._selected_keys_kernel, select, {"num_warps": 4, "num_stages": 1}) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_on_gpu_match_float64_reference():
    """Compiled for the GPU, bf16, the configured tiles, GLM-5's widths (64 heads, R 512, E 64) and
    top-256 of 1024 keys; bf16's 2^-8 relative rounding of P, dS and the outputs: 3e-2."""
    from glmtune.kernels import sparse_mla as sm

    q, c, index, valid, queries, keys, scale, latent = _case(0, torch.bfloat16, batch=2, queries=64, keys=1024,
                                                             heads=64, latent=512, rope=64, slots=256)
    q, c, index, valid = (x.cuda() for x in (q, c, index, valid))
    out, lse = _forward(sm, q, c, index, valid, queries, keys, scale, latent)
    leaves = [x.double().requires_grad_() for x in (q, c)]
    ref_out, _ = _float64_reference(leaves[0], leaves[1], index, valid, queries, keys, scale, latent)
    _close(out, ref_out, 2e-2)
    grad = torch.randn(out.shape, device="cuda").bfloat16()
    ref_dq, ref_dc = torch.autograd.grad(ref_out, leaves, grad.double())
    dq, dc = _backward(sm, grad, q, c, index, valid, out, lse, queries, keys, scale)
    _close(dq, ref_dq, 3e-2)
    _close(dc, ref_dc, 3e-2)
    from glmtune.models.glm5 import absorbed_attention as aa

    mask = torch.rand(2, 64, 3000, device="cuda") < 0.05  # over two 1024-key tiles; ~150 keys a query
    got = sm.selected_keys(mask, 256)
    want = aa.selected_keys(mask.cpu(), 256)  # the torch op on the CPU: the reference
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


def test_sparse_mla_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_kernels_match_float64_reference",
                                                   "check_kernels_match_the_torch_op",
                                                   "check_selected_keys_match_the_torch_op",
                                                   "check_model_backend_matches_absorbed"]


if __name__ == "__main__":
    main(check_kernels_match_float64_reference, check_kernels_match_the_torch_op, check_selected_keys_match_the_torch_op,
         check_model_backend_matches_absorbed)
