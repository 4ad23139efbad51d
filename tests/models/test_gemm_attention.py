"""The GEMM attention op against a float64 softmax reference: output, log-sum-exp and
gradients, with head groups, a non-contiguous mask slice and a query with no allowed key."""

import pytest
import torch

from glmtune.models.glm5 import gemm_attention as ga


def _reference(q, k, v, allowed, scale):
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no key attends nothing
    return probs @ v.double()


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    b, n, s, t, kd, vd = 2, 5, 6, 11, 8, 4
    q = torch.randn(b, n, s, kd, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, n, t, kd, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, n, t, vd, generator=g).to(dtype).requires_grad_()
    wide = torch.rand(b, s, t + 3, generator=g) < 0.5
    allowed = wide[:, :, 2 : 2 + t]  # a strided view, as the attention blocks pass it
    allowed[0, 1] = False  # no allowed key at all
    allowed[1, 2, 3] = True
    return q, k, v, allowed, kd**-0.5


@pytest.mark.parametrize("group_elements", [1 << 28, 2 * 6 * 11])  # all heads at once / two heads per group
def test_gemm_attention_matches_float64_reference(monkeypatch, group_elements):
    monkeypatch.setattr(ga, "SCORE_ELEMENTS_PER_GROUP", group_elements)
    q, k, v, allowed, scale = _inputs(torch.float32)
    grad = torch.randn(2, 5, 6, 4, generator=torch.Generator().manual_seed(1))
    out, lse = ga.gemm_attention(q, k, v, allowed, scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref = _reference(q, k, v, allowed, scale)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad.double())
    assert not out.isnan().any() and torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    for mine, theirs in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        assert torch.allclose(mine.double(), theirs.double(), atol=1e-5), (mine.double() - theirs.double()).abs().max()
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    ref_lse = logits.masked_fill(~allowed.unsqueeze(1), float("-inf")).logsumexp(-1)
    live = allowed.any(-1).unsqueeze(1).expand_as(lse)
    assert torch.allclose(lse[live].double(), ref_lse[live], atol=1e-5)


def test_bf16_rounds_like_flash_attention():
    """bf16 inputs: scores stay fp32, P and dS are rounded once to bf16 (as flash does)."""
    q, k, v, allowed, scale = _inputs(torch.bfloat16)
    out, _ = ga.gemm_attention(q, k, v, allowed, scale)
    ref = _reference(q, k, v, allowed, scale)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 2e-2


def test_op_registration_is_consistent():
    q, k, v, allowed, scale = _inputs(torch.float32)
    torch.library.opcheck(ga.gemm_attention, (q, k, v, allowed.contiguous(), scale))
