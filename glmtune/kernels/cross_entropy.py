"""Cross-entropy of one slice of logits and its gradient, in place, as one Triton kernel.

For a slice of N rows of V logits (GLM-5: 2048 x 154,880 bf16, 634 MB) the fused LM-head
loss needs each row's loss (log-sum-exp minus the target's logit) and d(loss)/d(logits) =
softmax - one_hot. One program per row reads the row twice (an online max / sum-exp pass,
then the softmax pass) and writes the gradient over the logits it came from: no second
[N, V] buffer, ~1.9 GB of traffic per slice. Arithmetic in fp32 like the eager reference
(`glmtune.models.common.loss._slice_loss_and_grad`), one rounding to the logits' dtype.
Asked for, the first pass also finds each row's argmax (the greedy token: the first column
holding the row's largest logit, as torch.argmax; a NaN logit is not counted), so a metric that
needs the model's greedy tokens costs no second LM-head GEMM.
`tests/kernels/test_cross_entropy.py` compares the two (in Triton's CPU interpreter).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096


def _cross_entropy_kernel(logits_ptr, targets_ptr, losses_ptr, greedy_ptr, vocab, row_stride, BLOCK: tl.constexpr,
                          GREEDY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)
    run_arg = tl.zeros([BLOCK], dtype=tl.int64)  # each lane's first column holding its running max
    for start in range(0, vocab, BLOCK):
        inside = start + cols < vocab
        x = tl.load(base + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if GREEDY:
            run_arg = tl.where(x > run_max, start + cols, run_arg)  # strictly: a lane keeps its first max
        new_max = tl.maximum(run_max, x)
        # Lanes that have seen only -inf keep a zero sum (avoid inf - inf).
        seen = new_max > float("-inf")
        rescale = tl.where(seen, tl.exp(run_max - new_max), 0.0)
        run_sum = run_sum * rescale + tl.where(seen, tl.exp(x - new_max), 0.0)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    if GREEDY:  # the first column of the row's max: the smallest of the lanes' that reached it
        tl.store(greedy_ptr + row, tl.min(tl.where(run_max == row_max, run_arg, vocab), axis=0))
    total = tl.sum(tl.where(run_max > float("-inf"), run_sum * tl.exp(run_max - row_max), 0.0), axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(targets_ptr + row)
    target_logit = tl.load(base + target).to(tl.float32)
    tl.store(losses_ptr + row, lse - target_logit)
    for start in range(0, vocab, BLOCK):
        inside = start + cols < vocab
        x = tl.load(base + start + cols, mask=inside, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
        tl.store(base + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)


@functools.cache
def _compiled():
    return triton.jit(_cross_entropy_kernel)  # the CPU interpreter under TRITON_INTERPRET=1


def cross_entropy_grad_(logits_NV: torch.Tensor, targets_N: torch.Tensor,
                        greedy_N: torch.Tensor | None = None) -> torch.Tensor:
    """Overwrites `logits` with softmax - one_hot(targets); returns the fp32 sum of the row losses.
    `greedy_N` (int64 [N]), when given, receives each row's argmax (module docstring).

    Every target must be a valid column (the caller drops ignored rows first)."""
    assert logits_NV.dim() == 2 and logits_NV.stride(1) == 1, logits_NV.stride()
    rows, vocab = logits_NV.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
    assert greedy_N is None or (greedy_N.shape == (rows,) and greedy_N.dtype == torch.long), greedy_N
    if rows:
        _compiled()[(rows,)](logits_NV, targets_N, losses, losses if greedy_N is None else greedy_N, vocab,
                             logits_NV.stride(0), BLOCK=BLOCK, GREEDY=greedy_N is not None, num_warps=8)
    return losses.sum()
