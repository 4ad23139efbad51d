"""The chunked loss equals the plain full-logits cross-entropy, value and gradients."""

import torch

from glmtune.models.common.loss import IGNORE_INDEX, chunked_cross_entropy, full_cross_entropy


def test_chunked_matches_full_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :5] = IGNORE_INDEX
    targets[1, -3:] = IGNORE_INDEX

    loss_c, n_c = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
    (loss_c / n_c).backward()
    grads_c = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    loss_f, n_f = full_cross_entropy(hidden @ weight.T, targets)
    (loss_f / n_f).backward()
    assert n_c == n_f == 2 * 37 - 8
    assert torch.allclose(loss_c, loss_f, rtol=1e-6)
    assert torch.allclose(grads_c[0], hidden.grad, atol=1e-6)
    assert torch.allclose(grads_c[1], weight.grad, atol=1e-6)
    assert torch.all(grads_c[0][0, :5] == 0)  # unsupervised positions get no gradient
