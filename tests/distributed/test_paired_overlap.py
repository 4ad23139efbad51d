"""`paired_overlap`: a forward and a backward taking strict turns at the transfers they issue.

The order of turns is what makes every rank issue its collectives in one order, so it is checked
exactly here; tests/distributed/test_expert_parallel_train.py trains DualPipeV with the turns on
gloo ranks (losses equal the sequential pairs' bit for bit and one process's).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from glmtune.distributed import paired_overlap, token_exchange
from glmtune.distributed.loopback import join_loopback_world
from glmtune.distributed.paired_overlap import handed_over, run_pair
from glmtune.distributed.token_exchange import AllToAllTokenDispatcher


def test_turns_alternate_at_each_hand_over_and_a_finished_side_leaves_the_other_alone():
    order = []

    def forward():
        for step in ("f1", "f2", "f3"):
            order.append(step)
            paired_overlap.hand_over()

    def backward():
        order.append("b1")
        paired_overlap.hand_over()
        order.append("b2")
        paired_overlap.hand_over()
        order.append("b3")
        paired_overlap.hand_over()  # the forward's turn: it finishes, so b4 runs without waiting again
        order.append("b4")
        paired_overlap.hand_over()  # the forward has finished: not a turn
        order.append("b5")

    handovers = run_pair(forward, backward)
    assert order == ["f1", "b1", "f2", "b2", "f3", "b3", "b4", "b5"]
    assert handovers == {"forward": 3, "backward": 3}
    assert paired_overlap.active() is None


def test_autograd_hands_over_in_the_backward_pass_and_the_values_are_unchanged():
    """A hand-over node's forward and backward each give the other side a turn; the backward side's
    autograd runs its nodes on its own thread (CPU), which counts as the backward side."""
    order = []
    x = torch.arange(4.0, requires_grad=True)
    y_saved = handed_over(x * 2)  # made outside a pair: no turns, the node is in the graph all the same
    loss = (y_saved ** 2).sum()

    def forward():
        order.append("forward starts")
        z = handed_over(torch.ones(3))
        order.append("forward resumes")
        assert torch.equal(z, torch.ones(3))

    def backward():
        order.append(f"backward starts on the second thread: {threading.current_thread().name.split('_')[0]}")
        loss.backward()
        order.append("backward resumes")

    run_pair(forward, backward)
    assert order == ["forward starts", "backward starts on the second thread: glmtune-paired-backward",
                     "forward resumes", "backward resumes"]
    assert torch.equal(x.grad, 8 * torch.arange(4.0))


def test_an_error_on_either_side_is_raised_after_both_stop():
    finished = []

    def failing_backward():
        paired_overlap.hand_over()
        raise RuntimeError("backward side failed")

    def forward():
        paired_overlap.hand_over()
        paired_overlap.hand_over()  # the backward has failed and finished: no wait
        finished.append("forward")

    with pytest.raises(RuntimeError, match="backward side failed"):
        run_pair(forward, failing_backward)
    assert finished == ["forward"]

    def failing_forward():
        paired_overlap.hand_over()
        raise ValueError("forward side failed")

    with pytest.raises(ValueError, match="forward side failed"):
        run_pair(failing_forward, lambda: finished.append("backward"))
    assert finished == ["forward", "backward"] and paired_overlap.active() is None


def test_a_paired_dispatch_hands_over_while_its_counts_come_to_the_host(monkeypatch):
    """The counts' copy to the host (the rows' split sizes) is where a dispatch waits for the device. A
    blocking copy would also wait for every kernel the other side queued; under the pairs the other side
    runs while the copy lands instead: its turn comes between the counts' exchange and the rows'."""
    order = []
    send_rows = token_exchange._send_rows
    monkeypatch.setattr(token_exchange, "_send_rows", lambda *a, **k: order.append("rows") or send_rows(*a, **k))
    generator = torch.Generator().manual_seed(0)
    x_TD, weights_TK = torch.randn(4, 8, generator=generator), torch.rand(4, 2, generator=generator)
    experts_TK = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])

    def other_side() -> None:
        order.append("other")
        paired_overlap.hand_over()
        order.append("other")

    with join_loopback_world(0, 2):
        dispatcher = AllToAllTokenDispatcher(dist.group.WORLD, num_local_experts=2)
        dispatcher.hands_over = True
        handovers = run_pair(lambda: dispatcher.dispatch_start(x_TD, experts_TK, weights_TK, 4), other_side)
    assert order == ["other", "rows", "other"]
    assert handovers == {"forward": 2, "backward": 1}
