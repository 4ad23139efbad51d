"""The in-place cross-entropy kernel against the eager slice reference (loss sum and
softmax - one_hot), in Triton's CPU interpreter (child process, fp32 logits)."""

import pytest
import torch
from hopper_compile import compile_for_hopper
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def check_matches_eager_slice_reference():
    from glmtune.kernels import cross_entropy
    from glmtune.models.common.loss import _slice_loss_and_grad

    gen = torch.Generator().manual_seed(0)
    vocab = 2 * cross_entropy.BLOCK + 37  # a partial last block
    logits = torch.randn(5, vocab, generator=gen) * 6
    logits[1, :100] = float("-inf")  # masked-out columns
    targets = torch.tensor([0, 100, vocab - 1, cross_entropy.BLOCK, 7])
    expected_loss, expected_grad = _slice_loss_and_grad(logits, targets)
    work = logits.clone()
    loss = cross_entropy.cross_entropy_grad_(work, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(work, expected_grad, rtol=1e-5, atol=1e-6)
    strided = torch.randn(3, vocab + 11, generator=gen)[:, :vocab]  # rows with a stride != vocab
    expected_loss, expected_grad = _slice_loss_and_grad(strided.clone(), targets[:3])
    torch.testing.assert_close(cross_entropy.cross_entropy_grad_(strided, targets[:3]), expected_loss,
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(strided, expected_grad, rtol=1e-5, atol=1e-6)


def check_greedy_tokens_are_torch_argmax():
    """The argmax the kernel finds in its first pass: torch.argmax's (the first column of the row's
    largest logit), across blocks and lanes, with ties inside a lane and across lanes, a row whose
    max is in the partial last block, and a row of -inf but one column; the loss and gradient are
    the same as without it."""
    from glmtune.kernels import cross_entropy

    gen = torch.Generator().manual_seed(1)
    vocab = 2 * cross_entropy.BLOCK + 37
    logits = torch.randn(6, vocab, generator=gen)
    logits[0, [5, 5 + cross_entropy.BLOCK]] = 9.0  # a tie in one lane: the earlier block's column
    logits[1, [cross_entropy.BLOCK + 3, 11]] = 9.0  # a tie across lanes: the smaller column
    logits[2, vocab - 1] = 9.0  # in the partial last block
    logits[3, :] = float("-inf")
    logits[3, 4000] = 0.5
    targets = torch.tensor([0, 1, 2, 4000, 4, 5])
    greedy = torch.full((6,), -7, dtype=torch.long)
    work, plain = logits.clone(), logits.clone()
    loss = cross_entropy.cross_entropy_grad_(work, targets, greedy)
    assert torch.equal(greedy, logits.argmax(-1)), (greedy, logits.argmax(-1))
    assert greedy[:4].tolist() == [5, 11, vocab - 1, 4000]
    assert torch.equal(loss, cross_entropy.cross_entropy_grad_(plain, targets)) and torch.equal(work, plain)


def test_cross_entropy_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_matches_eager_slice_reference",
                                                   "check_greedy_tokens_are_torch_argmax"]


def test_kernel_compiles_for_hopper_with_and_without_greedy_tokens():
    from glmtune.kernels import cross_entropy

    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")
    pointers = {"targets_ptr": "*i64", "losses_ptr": "*fp32", "greedy_ptr": "*i64"}
    for greedy in (False, True):
        compile_for_hopper(cross_entropy._compiled(), {"BLOCK": cross_entropy.BLOCK, "GREEDY": greedy},
                           {"num_warps": 8, "num_stages": 1}, pointers)


if __name__ == "__main__":
    main(check_matches_eager_slice_reference, check_greedy_tokens_are_torch_argmax)
