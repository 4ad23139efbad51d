"""The distillation KL term (glmtune/models/common/distill_loss.py) against a direct computation in
fp64: the teacher's top-K with the remaining mass as one bucket, the student's exact mass outside
the K ids, both tempered over the K + 1 buckets, T² scaled, forward KL."""

import math

import pytest
import torch

from glmtune.models.common.distill_loss import TeacherTopK, chunked_topk_kl, topk_kl_reference


def _direct(logits_V: list[float], ids: list[int], teacher_logps: list[float], temperature: float) -> float:
    """One position by hand: probabilities, buckets, temperature, KL (plain Python floats)."""
    peak = max(logits_V)
    exp = [math.exp(z - peak) for z in logits_V]
    q = [e / sum(exp) for e in exp]
    p_buckets = [math.exp(lp) for lp in teacher_logps]
    p_buckets.append(max(0.0, 1.0 - sum(p_buckets)))
    q_buckets = [q[i] for i in ids]
    q_buckets.append(sum(q[j] for j in range(len(q)) if j not in ids))

    def tempered(probs):
        powered = [x ** (1.0 / temperature) for x in probs]
        return [x / sum(powered) for x in powered]

    p_t, q_t = tempered(p_buckets), tempered(q_buckets)
    return temperature ** 2 * sum(p * math.log(p / qq) for p, qq in zip(p_t, q_t) if p > 0)


def _teacher(generator, B, T, K, V, dtype=torch.float64, mask_share=0.7):
    ids = torch.stack([torch.randperm(V, generator=generator)[:K] for _ in range(B * T)]).view(B, T, K)
    # A teacher that holds 60-95% of its mass in its top-K: the bucket holds the rest.
    raw = torch.rand(B, T, K, generator=generator, dtype=dtype) + 0.1
    held = 0.6 + 0.35 * torch.rand(B, T, 1, generator=generator, dtype=dtype)
    logps = (raw / raw.sum(-1, keepdim=True) * held).log()
    mask = torch.rand(B, T, generator=generator) < mask_share
    return ids, logps, mask


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_equals_direct_computation_fp64(temperature):
    g = torch.Generator().manual_seed(0)
    B, T, K, V, D = 2, 5, 4, 11, 6
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    ids, logps, mask = _teacher(g, B, T, K, V)
    teacher = TeacherTopK(ids, logps, mask, weight=1.0, temperature=temperature)
    logits = hidden @ weight.T
    expected = sum(_direct(logits[b, t].tolist(), ids[b, t].tolist(), logps[b, t].tolist(), temperature)
                   for b in range(B) for t in range(T) if mask[b, t])
    chunked = chunked_topk_kl(hidden, weight, teacher, chunk_size=3)
    assert chunked.dtype == torch.float64
    counted = TeacherTopK.on_host(ids, logps, mask)  # the host count spares the sync: the same sum
    counted = TeacherTopK(counted.ids, counted.logps, counted.mask, 1.0, temperature, counted.count)
    assert torch.equal(chunked_topk_kl(hidden, weight, counted, chunk_size=3), chunked)
    assert chunked.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert topk_kl_reference(logits, teacher).item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_bucket_takes_the_remaining_mass():
    """A teacher whose top-K holds all its mass leaves an empty bucket (no term); the same student
    against a teacher holding half its mass outside the K ids gets the bucket's term."""
    V, K = 6, 2
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ids = torch.tensor([[[0, 1]]])
    mask = torch.tensor([[True]])
    full = torch.tensor([[[math.log(0.7), math.log(0.3)]]], dtype=torch.float64)
    half = torch.tensor([[[math.log(0.35), math.log(0.15)]]], dtype=torch.float64)
    for logps in (full, half):
        teacher = TeacherTopK(ids, logps, mask, weight=1.0)
        expected = _direct(logits[0].tolist(), [0, 1], logps[0, 0].tolist(), 1.0)
        assert topk_kl_reference(logits[None], teacher).item() == pytest.approx(expected, rel=1e-12)
    assert V > K


def test_kl_is_zero_when_student_matches_teacher_and_gradients_match_reference():
    g = torch.Generator().manual_seed(1)
    B, T, K, V, D = 1, 4, 3, 9, 5
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    logits = hidden.detach() @ weight.detach().T
    top = torch.log_softmax(logits, -1).topk(K, dim=-1)
    teacher = TeacherTopK(top.indices, top.values, torch.ones(B, T, dtype=torch.bool), 1.0, 2.0)
    assert chunked_topk_kl(hidden.detach(), weight.detach(), teacher).abs().item() < 1e-13
    # gradients through the chunked (checkpointed) path equal autograd over materialized logits
    other = TeacherTopK(top.indices.roll(1, dims=-1), top.values, teacher.mask, 1.0, 2.0)
    chunked = chunked_topk_kl(hidden, weight, other, chunk_size=2)
    g_h, g_w = torch.autograd.grad(chunked, (hidden, weight))
    reference = topk_kl_reference(hidden @ weight.T, other)
    r_h, r_w = torch.autograd.grad(reference, (hidden, weight))
    assert chunked.item() > 0
    torch.testing.assert_close(g_h, r_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_w, r_w, rtol=1e-12, atol=1e-12)
