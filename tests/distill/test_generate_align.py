"""`align`: the teacher's positions laid on the rendered turn's tokens (matched runs keep their
top-K, in order; the others carry no entry)."""

from __future__ import annotations

import numpy as np

from glmtune.distill.align import align
from glmtune.distill.teacher_logprobs import TopK


def _topk(tokens: list[int]) -> TopK:
    n = len(tokens)
    ids = np.stack([np.array(tokens), np.array(tokens) + 100], axis=1).astype(np.int32)
    logprobs = np.stack([-np.arange(1, n + 1) / 10, np.full(n, -5.0)], axis=1).astype(np.float32)
    return TopK(np.array(tokens, np.int32), ids, logprobs)


def test_matched_runs_keep_their_topk_and_the_rest_is_empty():
    # the teacher: " hello" (7) "world" (8, 9) then its stop token 2; the template renders '</think>'
    # (1) first, strips the space ("hello": 3) and ends the turn with 2
    teacher = _topk([7, 8, 9, 2])
    laid = align(teacher, [1, 3, 8, 9, 2])
    assert laid.generated.tolist() == [-1, -1, 8, 9, 2]
    assert laid.ids[2:].tolist() == teacher.ids[1:].tolist()
    assert laid.logprobs[2:].tolist() == teacher.logprobs[1:].tolist()
    assert (laid.ids[:2] == -1).all() and np.isneginf(laid.logprobs[:2]).all()


def test_order_is_kept_and_nothing_is_matched_twice():
    laid = align(_topk([5, 6, 5, 6]), [5, 6])
    assert laid.generated.tolist() == [5, 6] and laid.logprobs[:, 0].tolist() == [np.float32(-0.1), np.float32(-0.2)]
    assert align(_topk([]), [4, 4]).generated.tolist() == [-1, -1]
    assert align(_topk([4]), []).ids.shape == (0, 2)
