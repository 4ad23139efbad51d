"""One pipeline rank's forward and backward of two microbatches side by side: DualPipeV's paired
actions, with one's expert all-to-alls travelling while the other computes.

torch's DualPipeV schedule pairs, in its steady state, the forward of one microbatch on one of a
rank's two stages with the backward of another microbatch on the other stage (an `OVERLAP_F_B`
action) and runs them one after the other. `overlap_f_b`, registered as that action's function
(`parallel.pp_ep_overlap`, `glmtune/distributed/pipeline.py`), runs the backward on a second thread
(one per process, `run_pair`) and lets the two take turns on the host (`Turns`): each runs until it has issued an expert
all-to-all (the token dispatcher calls `handed_over` on the rows it sends, forward and backward),
then hands the host to the other. The other's kernels queue on the compute stream behind the
issue, so they run while the rows travel on the communication stream; the transfer is waited
only when its owner's turn comes back. This is the overlap of DeepSeek-V3's DualPipe and of
torchtitan's DualPipeV with expert parallelism, here with strict turns instead of a barrier.

Turns are strict: one thread runs at a time and hands over only at an issue. So every rank of
an expert group issues its collectives in one order (the sequence of turns is the model's, the
same on every rank of a stage), no Python state is touched by two threads at once, and each
microbatch computes what it computed before: losses and gradients equal the sequential pair's
bit for bit (tests/distributed/test_expert_parallel_train.py; the turns' order:
tests/distributed/test_paired_overlap.py). What one side's turn holds up (a host
sync such as the count exchange's) the other's queued kernels cover.

On a CPU the turns cost compute: the waiting side's OpenMP threads spin after its last operator and
take cores from the running side (the tiny DualPipeV rank of docs/distributed.md: 1.2 -> 1.7 s of compute
per step; equal under OMP_WAIT_POLICY=PASSIVE). A GPU's host threads only launch kernels: the overlap is
meant for GPUs.

The two sides are told apart by thread: the forward is the thread that opened the turns; any
other thread is the backward's (its own thread, or autograd's device thread, which runs CUDA
backward nodes and a checkpointed layer's recomputation).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch.distributed.pipelining.schedules import _wait_batch_p2p

FORWARD, BACKWARD = "forward", "backward"


def _other(side: str) -> str:
    return BACKWARD if side == FORWARD else FORWARD


class Turns:
    """Two sides running one at a time: the forward (the opening thread) starts; each hands the
    host over at `hand_over`; a side that has finished leaves the other to run alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._forward_thread = threading.get_ident()
        self._turn = FORWARD
        self._done: set[str] = set()
        self.handovers = {FORWARD: 0, BACKWARD: 0}  # per side: how often it gave the host up

    def side(self) -> str:
        return FORWARD if threading.get_ident() == self._forward_thread else BACKWARD

    def hand_over(self) -> None:
        """Gives the host to the other side (unless it has finished) and waits for it back."""
        side = self.side()
        other = _other(side)
        with self._cond:
            if other in self._done:
                return
            assert self._turn == side, f"the {side} side handed over out of turn"
            self._turn = other
            self.handovers[side] += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side or other in self._done)

    def wait_turn(self, side: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side or _other(side) in self._done)

    def finish(self, side: str) -> None:
        with self._cond:
            self._done.add(side)
            self._turn = _other(side)
            self._cond.notify_all()


_ACTIVE: list[Turns] = []  # the turns of the pair running now (at most one per process)


def active() -> Turns | None:
    return _ACTIVE[-1] if _ACTIVE else None


def hand_over() -> None:
    """Where a side has just issued a transfer: the other side's turn, if a pair is running."""
    turns = active()
    if turns is not None:
        turns.hand_over()


class _HandOver(torch.autograd.Function):
    """An identity on rows just sent: hands over after the forward's issue and, in backward (which
    reaches it right after the gradient's transfer is issued, `token_exchange._ReceiveRows`),
    after that issue."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor) -> torch.Tensor:
        hand_over()
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        hand_over()
        return grad


def handed_over(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (an exchange's output, issued and not yet waited), after a hand-over in forward and
    one in backward. Applied whether or not a pair runs now: a microbatch's forward may run alone and
    its backward in a pair."""
    return _HandOver.apply(rows)


@contextmanager
def _opened() -> Iterator[Turns]:
    assert not _ACTIVE, "one pair at a time"
    turns = Turns()
    _ACTIVE.append(turns)
    try:
        yield turns
    finally:
        _ACTIVE.clear()


@functools.cache
def _backward_thread() -> ThreadPoolExecutor:
    # One thread for every pair of the process, not one per pair: neither a thread's start nor, on a CPU,
    # its OpenMP team for torch's operators is paid per pair.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="glmtune-paired-backward")


os.register_at_fork(after_in_child=_backward_thread.cache_clear)  # a forked child has none of its parent's threads


def run_pair(forward: Callable[[], None], backward: Callable[[], None]) -> dict[str, int]:
    """Runs `forward` here and `backward` on the backward thread, taking turns (module docstring);
    returns each side's hand-overs. An exception on either side is raised here after both have stopped."""
    errors: list[BaseException] = []
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    with _opened() as turns:
        def backward_side() -> None:
            try:
                if stream is not None:
                    torch.cuda.set_stream(stream)
                turns.wait_turn(BACKWARD)
                backward()
            except BaseException as error:  # noqa: BLE001 (re-raised in the calling thread)
                errors.append(error)
            finally:
                turns.finish(BACKWARD)

        done = _backward_thread().submit(backward_side)
        try:
            forward()
        finally:
            turns.finish(FORWARD)
            done.result()
    if errors:
        raise errors[0]
    return dict(turns.handovers)


# -- the schedule's paired action ---------------------------------------------------------------
# What torch's runtime does for a FORWARD and a FULL_BACKWARD action (`_PipelineScheduleRuntime`'s
# `_perform_action`, torch 2.11-2.13), split so that the two run as a pair: both receives are waited
# first, both sends follow the action (the runtime's lowering puts them after it).

def _stages(schedule) -> dict[int, object]:
    return {stage.stage_index: stage for stage in schedule._stages}


def _forward_part(schedule, ctx, action, stages) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    if not stage.is_first and index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))

    def run() -> None:
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if index + 1 in stages:  # torch's V-schedule special case: the next stage is on this rank
            stages[index + 1].set_local_fwd_input(output, mb)
    return run


def _backward_part(schedule, action, stages) -> Callable[[], None]:
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    schedule._assert_unsharded(stage)
    if not stage.is_last and index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[index] += 1
    last = schedule.backward_counter[index] == schedule._n_microbatches

    def run() -> None:
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if index - 1 in stages:
            stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
    return run


def overlap_f_b(action, ctx) -> None:
    """The `OVERLAP_F_B` action's function (`_PipelineScheduleRuntime.register_custom_function`): its
    forward and full backward as a pair (`run_pair`)."""
    schedule = ctx.schedule_ref
    forward_action, backward_action = action.sub_actions
    assert forward_action.computation_type.name == "FORWARD", action
    assert backward_action.computation_type.name == "FULL_BACKWARD", action
    stages = _stages(schedule)
    forward = _forward_part(schedule, ctx, forward_action, stages)
    backward = _backward_part(schedule, backward_action, stages)
    run_pair(forward, backward)
