"""One rank of an N-rank world, alone in one process: collectives with local stand-ins.

`glmtune plan --measure` runs exactly what rank R of a recipe's job runs (its FSDP shards, its
experts, its micro-batch) on the one GPU at hand. The model, the parallelization plan, FSDP2,
the token dispatcher and the trainer are the real ones; only the process group is not. This
module's `LoopbackProcessGroup` is registered as a torch.distributed backend and joined as
rank R of a world of N (`join_loopback_world`), so `DeviceMesh`, FSDP2 and
torch.distributed's functional collectives call it exactly where they would call NCCL.

Each collective allocates what the real one would (its callers allocate the outputs, at their
real sizes) and moves the same bytes on this device, filled as if **every other rank were a
copy of this one**:

  * all-gather: each of the N slots receives this rank's input (FSDP2 gathers a parameter of
    its full size, made of N copies of the local shard);
  * reduce-scatter / all-reduce with SUM: N times this rank's own part (AVG, MAX, MIN: its
    own part), the sum over N identical ranks;
  * all-to-all: what this rank sends to rank s comes back as what s sends to it. Under expert
    parallelism each local expert then receives the rows this rank's real router sends to the
    expert at the same position on each of the ep ranks: T*K rows in all (the number a rank
    receives when routing is balanced), split over the local experts as the router splits them;
  * broadcast, barrier: nothing to move (the root is a copy); send: nothing leaves; recv: the
    buffer is filled with what this rank last sent with that shape and dtype, else normal(0, 1)
    (floating point: a hidden state's scale) or ones (a vote, a flag or a selection mask:
    "yes", as this rank would send it).

With identical ranks the stand-ins are exact: when every rank of a real world is fed the
same batch (and holds shards that are copies), a data-parallel rank computes here what it
computes there. Expert, context and pipeline parallelism differ by construction (other ranks
hold other experts, other queries, other layers): their shapes and bytes are the real ones,
the values are not. Time spent in collectives here is a local copy; the real transfer time is
an estimate from bytes and link bandwidths (`glmtune.plan.measure`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from glmtune.distributed.link_emulator import active_emulator

try:  # both of DTensor's sharding caches (torch >= 2.9); before, the Python one was the only one
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
except ImportError:
    from torch.distributed.tensor.debug import _clear_python_sharding_prop_cache as _clear_sharding_prop_cache

BACKEND = "glmtune_loopback"
# A group's options carry a ReduceOp, which equals (==) these but does not hash like them.
_KEEPS = (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def _completed(result) -> dist.Work:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class LoopbackProcessGroup(dist.ProcessGroup):
    """Rank `rank` of a group of `size`, every other member a copy of it (module docstring).
    Both method spellings are here: torch 2.11's (`_allgather_base`, ...) and 2.13's."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = ""
        self._sent: dict[tuple, torch.Tensor] = {}  # (shape, dtype) -> the last tensor sent
        self.moved_bytes: dict[str, int] = {}  # collective -> bytes its outputs received
        self.calls: dict[str, int] = {}  # collective -> how many were issued

    # -- what torch.distributed asks of a group -----------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _run(self, op: str, move: Callable[[], None], result, received: Sequence[torch.Tensor],
             touched: Sequence[torch.Tensor] = ()) -> dist.Work:
        """Do `move` (the stand-in's local copies) and complete with `result`: at once, or on this
        group's lane when links are emulated (`link_emulator.py`). `received` are the tensors whose
        bytes the collective delivers here; `touched`, any other tensor `move` reads or writes."""
        count = sum(t.numel() * t.element_size() for t in received)
        self.moved_bytes[op] = self.moved_bytes.get(op, 0) + count
        self.calls[op] = self.calls.get(op, 0) + 1
        emulator = active_emulator()
        if emulator is None:
            move()
            return _completed(result)
        lane = emulator.lane(self)
        return lane.submit(op, move, emulator.seconds(self, op, count), result, [*received, *touched])

    # -- all-gather -----------------------------------------------------------------------
    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        slots, flat = output.view(self._size, -1), input.reshape(-1)
        for slot in slots:
            if slot.data_ptr() != flat.data_ptr():  # FSDP2 gathers in place: its input is its own slot
                slot.copy_(flat)

    def _allgather_base(self, output, input, opts=None):
        return self._run("all_gather", lambda: self._gather_into(output, input), output, [output], [input])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def move() -> None:
            for output, input in zip(outputs, inputs):
                self._gather_into(output, input)
        return self._run("all_gather", move, outputs, outputs, inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        def move() -> None:
            for outputs, input in zip(output_lists, inputs):
                for output in outputs:
                    if output.data_ptr() != input.data_ptr():
                        output.copy_(input)
        return self._run("all_gather", move, output_lists, [t for ts in output_lists for t in ts], inputs)

    # -- reductions ----------------------------------------------------------------------------
    def _reduced(self, tensor: torch.Tensor, opts) -> torch.Tensor:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        if op == dist.ReduceOp.SUM:
            return tensor.mul_(self._size) if tensor.dtype != torch.bool else tensor
        assert any(op == keep for keep in _KEEPS), f"the loopback group has no stand-in for {op}"
        return tensor

    def _reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, opts) -> None:
        output.copy_(input.reshape(self._size, -1)[self._rank].view_as(output))
        self._reduced(output, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._run("reduce_scatter", lambda: self._reduce_scatter_into(output, input, opts), output,
                         [output], [input])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        def move() -> None:
            for output, input in zip(outputs, inputs):
                self._reduce_scatter_into(output, input, opts)
        return self._run("reduce_scatter", move, outputs, outputs, inputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        def move() -> None:
            for output, inputs in zip(outputs, input_lists):
                output.copy_(inputs[self._rank])
                self._reduced(output, opts)
        return self._run("reduce_scatter", move, outputs, outputs, [t for ts in input_lists for t in ts])

    def allreduce(self, tensors, opts=None):
        def move() -> None:
            for tensor in tensors:
                self._reduced(tensor, opts)
        return self._run("all_reduce", move, tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    # -- all-to-all ---------------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        assert list(output_split_sizes or []) == list(input_split_sizes or []), \
            "a loopback all-to-all receives from rank s what it sends to s: the splits are equal"
        return self._run("all_to_all", lambda: output.copy_(input), output, [output], [input])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        def move() -> None:
            for output, input in zip(outputs, inputs):
                output.copy_(input)
        return self._run("all_to_all", move, outputs, outputs, inputs)

    # -- the rest ------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        return _completed(tensors)

    def barrier(self, opts=None):
        return _completed(None)

    def send(self, tensors, dst, tag=0):
        def move() -> None:
            for tensor in tensors:
                self._sent[(tuple(tensor.shape), tensor.dtype)] = tensor.detach().clone()
        return self._run("send", move, None, tensors)

    @torch.no_grad()  # a pipeline receives into leaf buffers that require grad
    def recv(self, tensors, src, tag=0):
        def move() -> None:
            for tensor in tensors:
                last = self._sent.get((tuple(tensor.shape), tensor.dtype))
                if last is not None:
                    tensor.copy_(last)
                elif tensor.is_floating_point():  # a hidden state's scale (zeros make a later stage's norms degenerate)
                    tensor.normal_()
                else:  # a vote, a flag or a selection mask: "yes", what a copy of this rank sends
                    tensor.fill_(1)
        return self._run("recv", move, tensors, tensors)


def _create(store, rank: int, size: int, timeout) -> LoopbackProcessGroup:
    return LoopbackProcessGroup(rank, size)


def register_backend() -> None:
    """Make `BACKEND` known to torch.distributed (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


@contextmanager
def join_loopback_world(rank: int, world_size: int) -> Iterator[LoopbackProcessGroup]:
    """This process as rank `rank` of `world_size`, on loopback groups; the world group yielded.
    Refused when a process group exists already (a real run's ranks have theirs)."""
    if dist.is_initialized():
        raise ValueError("a process group exists already: the loopback world replaces a real one, not both "
                         "(run `glmtune plan --measure` as one process, without torchrun)")
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank}: the recipe's world has ranks 0..{world_size - 1}")
    register_backend()
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        # DTensor's sharding caches keep this world's meshes, and so its group names, which die with
        # it: a later world of the same shape would find them there (a second --rank in one process).
        _clear_sharding_prop_cache()


def moved_bytes_by_group() -> dict[str, dict]:
    """Per loopback group of this process (by its mesh name or group name): its global ranks, the
    bytes each kind of collective received on it so far, and how many of each were issued."""
    out = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        if isinstance(group, LoopbackProcessGroup):
            out[name] = {"ranks": dist.get_process_group_ranks(group), "bytes": dict(group.moved_bytes),
                         "calls": dict(group.calls)}
    return out
