"""`chunked_token_logps` equals a plain full-logits log-softmax, in value and gradients
(wrt the hidden states and the head weight), with a per-token upstream gradient."""

import pytest
import torch

from glmtune.models.common.loss import IGNORE_INDEX, chunked_token_logps, full_token_logps
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset


def _case(seed=0, batch=2, seq=37, dim=16, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[0, :5] = IGNORE_INDEX
    targets[1, -3:] = IGNORE_INDEX
    upstream = torch.randn(batch, seq, generator=gen)  # a different weight per token, as document sums give
    return hidden, weight, targets, upstream


def _grads(fn, hidden, weight, targets, upstream):
    hidden.grad = weight.grad = None
    logp = fn()
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_size", [8, 4096])  # several slices (one partial), and one slice
@pytest.mark.parametrize("host_count", [False, True])
def test_matches_full_log_softmax(chunk_size, host_count):
    hidden, weight, targets, upstream = _case()
    count = int((targets != IGNORE_INDEX).sum()) if host_count else None
    logp, g_hidden, g_weight = _grads(lambda: chunked_token_logps(hidden, weight, targets, chunk_size, count),
                                      hidden, weight, targets, upstream)
    ref, r_hidden, r_weight = _grads(lambda: full_token_logps(hidden @ weight.T, targets),
                                     hidden, weight, targets, upstream)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert torch.all(logp[targets == IGNORE_INDEX] == 0) and torch.all(logp[targets != IGNORE_INDEX] < 0)
    torch.testing.assert_close(logp, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_hidden, r_hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_weight, r_weight, rtol=1e-6, atol=1e-6)
    assert torch.all(g_hidden[0, :5] == 0)  # unsupervised positions get no gradient


def test_frozen_head_and_no_supervised_token():
    hidden, weight, targets, upstream = _case(seed=1)
    weight.requires_grad_(False)  # LoRA: the head is frozen, only the hidden states need a gradient
    logp = chunked_token_logps(hidden, weight, targets, chunk_size=8)
    (logp * upstream).sum().backward()
    expected = torch.autograd.grad((full_token_logps(hidden @ weight.T, targets) * upstream).sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-5)
    hidden.grad = None
    nothing = torch.full_like(targets, IGNORE_INDEX)
    logp = chunked_token_logps(hidden, weight, nothing, chunk_size=8)
    logp.sum().backward()  # still a graph node: a micro-batch with no completion token backpropagates zeros
    assert torch.all(logp == 0) and torch.all(hidden.grad == 0)


def test_model_forward_option():
    """`token_logps=True` gives the per-token log-probabilities whose negated sum is the loss."""
    model = build_model(get_preset("tiny"), seed=0)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, model.args.vocab_size, (2, 12), generator=gen)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, :3] = IGNORE_INDEX
    with torch.no_grad():
        out = model(ids, MicroBatch(ids, targets=targets), token_logps=True, compute_logits=True)
        loss = model(ids, MicroBatch(ids, targets=targets))
    assert out.loss_sum is None and out.num_targets == loss.num_targets == 18
    torch.testing.assert_close(out.token_logps, full_token_logps(out.logits, targets), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(-out.token_logps.sum(), loss.loss_sum, rtol=1e-6, atol=1e-6)
