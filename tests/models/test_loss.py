"""Both chunked-loss backends equal the plain full-logits cross-entropy, value and gradients."""

import pytest
import torch

from glmtune.models.common.loss import IGNORE_INDEX, chunked_cross_entropy, full_cross_entropy


@pytest.mark.parametrize("backend", ["fused", "checkpoint"])
@pytest.mark.parametrize("scale", [1.0, 0.25])  # the upstream gradient is applied in backward
def test_chunked_matches_full_in_value_and_gradient(backend, scale):
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :5] = IGNORE_INDEX
    targets[1, -3:] = IGNORE_INDEX

    loss_c, n_c = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, backend=backend)
    (scale * loss_c / n_c).backward()
    grads_c = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    # The host-side count (no sync to find the supervised rows) gives the same result.
    loss_h, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, backend=backend, num_supervised=2 * 37 - 8)
    (scale * loss_h / n_c).backward()
    assert torch.equal(loss_h, loss_c) and torch.equal(hidden.grad, grads_c[0]) and torch.equal(weight.grad, grads_c[1])
    hidden.grad = weight.grad = None

    loss_f, n_f = full_cross_entropy(hidden @ weight.T, targets)
    (scale * loss_f / n_f).backward()
    assert n_c == n_f == 2 * 37 - 8
    assert torch.allclose(loss_c, loss_f, rtol=1e-6)
    assert torch.allclose(grads_c[0], hidden.grad, atol=1e-6)
    assert torch.allclose(grads_c[1], weight.grad, atol=1e-6)
    assert torch.all(grads_c[0][0, :5] == 0)  # unsupervised positions get no gradient


@pytest.mark.parametrize("backend", ["fused", "checkpoint"])
@pytest.mark.parametrize("announced", [1 / 66, 0.5])  # the factor applied, and a wrong announcement
def test_announced_grad_scale_gives_the_same_gradients(backend, announced):
    """`grad_scale` folds the caller's factor into the head-gradient GEMMs; the gradients
    equal the full-logits reference whether or not the announced factor is the one applied."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :8] = IGNORE_INDEX
    loss, count = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, backend=backend, grad_scale=announced)
    (loss / count).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss_f, n_f = full_cross_entropy(hidden @ weight.T, targets)
    (loss_f / n_f).backward()
    assert count == n_f == 66 and torch.allclose(loss, loss_f, rtol=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6) and torch.allclose(grads[1], weight.grad, atol=1e-6)


@pytest.mark.parametrize("backend", ["fused", "checkpoint"])
def test_no_supervised_token_gives_zero_loss_and_gradients(backend):
    hidden = torch.randn(1, 9, 16, requires_grad=True)
    weight = torch.full((50, 16), float("nan")).requires_grad_()  # uninitialized memory would leak through
    weight.data.normal_()
    targets = torch.full((1, 9), IGNORE_INDEX)
    loss, n = chunked_cross_entropy(hidden, weight, targets, chunk_size=4, backend=backend)
    loss.backward()
    assert n == 0 and loss == 0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_fused_bf16_close_to_fp32_reference():
    torch.manual_seed(1)
    hidden = torch.randn(64, 32)
    weight = torch.randn(300, 32) * 0.1
    targets = torch.randint(0, 300, (64,))
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    loss, _ = chunked_cross_entropy(h16, w16, targets, chunk_size=16, backend="fused")
    loss.backward()
    h32, w32 = hidden.requires_grad_(), weight.requires_grad_()
    ref, _ = full_cross_entropy(h32 @ w32.T, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-2
    assert (h16.grad.float() - h32.grad).norm() / h32.grad.norm() < 2e-2
    assert (w16.grad.float() - w32.grad).norm() / w32.grad.norm() < 2e-2


def test_frozen_head_gets_no_weight_gradient_and_the_same_hidden_gradient(monkeypatch):
    """LoRA freezes the LM head: the fused loss then skips the V x D weight-gradient GEMM."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 21, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    targets = torch.randint(0, 50, (2, 21))
    loss_f, n_f = full_cross_entropy(hidden @ weight.T, targets)
    (loss_f / n_f).backward()
    expected, hidden.grad = hidden.grad.clone(), None

    calls = []
    original = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    loss_c, n_c = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, backend="fused")
    (loss_c / n_c).backward()
    assert calls == [] and weight.grad is None
    torch.testing.assert_close(loss_c, loss_f, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("backward_twice", [False, True])
def test_gradients_are_released_once_backward_has_returned_them(backward_twice):
    """A pipeline schedule keeps each microbatch's loss node to the step's end: the node must not
    keep the V x D head gradient it returned (one per microbatch, and autograd would copy it instead
    of taking it over). A zero-bubble schedule calls backward twice (input, then weight gradients):
    the first call's gradients stay for the second, which returns the same and then releases them."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 21, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 21))
    loss, count = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, backward_twice=backward_twice)
    node = loss.grad_fn
    address = node.grads[1].data_ptr()
    (loss / count).backward(retain_graph=True)
    assert (node.grads is None) != backward_twice
    assert (weight.grad.data_ptr() == address) != backward_twice  # taken over, not copied (once released)
    if backward_twice:
        first = tuple(node.grads)
        again = node.apply(torch.tensor(1.0 / 42))  # the second call returns what the first computed
        assert again[0] is first[0] and again[1] is first[1] and node.grads is None
        reference, _ = full_cross_entropy(hidden @ weight.T, targets)
        torch.testing.assert_close(weight.grad, torch.autograd.grad(reference / count, weight)[0])


@pytest.mark.parametrize("path", ["fused", "checkpoint", "no_grad"])
def test_greedy_tokens_come_from_the_losss_own_logits_without_changing_it(path):
    """`greedy_BS`: each supervised position's argmax of hidden @ weight.T (the tokens a greedy decode
    emits), -1 at the others, from every backend's slices; the loss and its gradients are bit-identical
    to a call without it (what the MTP acceptance reads instead of two more head passes)."""
    torch.manual_seed(1)
    hidden = torch.randn(2, 23, 16, requires_grad=path != "no_grad")
    weight = torch.randn(40, 16, requires_grad=path != "no_grad")
    targets = torch.randint(0, 40, (2, 23))
    targets[0, :4] = IGNORE_INDEX
    targets[1, -2:] = IGNORE_INDEX
    backend = "checkpoint" if path == "checkpoint" else "fused"
    runs = []
    for greedy in (None, torch.full_like(targets, 7)):  # a buffer with stale values: every entry is written
        with torch.no_grad() if path == "no_grad" else torch.enable_grad():
            loss, count = chunked_cross_entropy(hidden, weight, targets, chunk_size=6, backend=backend, greedy_BS=greedy)
        grads = None
        if path != "no_grad":
            loss.backward()
            grads = hidden.grad.clone(), weight.grad.clone()
            hidden.grad = weight.grad = None
        runs.append((loss, count, grads, greedy))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    if path != "no_grad":
        assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    expected = torch.where(targets != IGNORE_INDEX, (hidden @ weight.T).argmax(-1), -1)
    assert torch.equal(runs[1][3], expected)
