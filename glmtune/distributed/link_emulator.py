"""Links a one-rank replica can feel: each loopback collective occupies a communication lane for
the time the link model gives it (`link_model.py`), so a measured step includes exactly the
communication its schedule fails to hide.

`glmtune plan --measure --emulate-links` runs rank R of a job alone (`loopback.py`): its
collectives are local copies, which take microseconds where the real transfers take
milliseconds. With emulation on, every loopback process group gets a lane, as NCCL gives every
communicator its own stream:

  * on CUDA the lane is a stream: the collective's stand-in copies run there (so they are not
    the rank's compute), then a spin kernel (`torch.cuda._sleep`, its cycles calibrated once
    against CUDA events) holds the stream for the modeled seconds; the returned work's `wait()`
    makes the caller's stream wait for the lane, as NCCL's work does. Compute that the schedule
    issued meanwhile runs beside it; compute that waits for the result does not;
  * on a CPU (the tests) the lane is a clock: the copies run at once, the collective ends at
    max(now, the lane's previous end) + its seconds, and `wait()` sleeps until then.

A lane's hold is a profiler range named `LANE_RANGE` + the lane's name (the group's mesh axes where the
caller names them, else its group name), so a profile tells the lanes apart (`plan/step_timeline.py`).
A lane runs its collectives one after another; lanes of different groups overlap each other
(the links of a real job are shared: concurrent collectives of two groups over the same NVLink
are not slowed here). The spin kernel occupies one SM; NCCL's kernels take 16-32, so compute
beside an emulated collective runs somewhat faster than beside a real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.profiler import record_function

from glmtune.distributed.link_model import Links, collective_seconds

LANE_RANGE = "link lane "  # + the lane's name: the profiler range around each modeled hold


@dataclass
class LaneLog:
    """What a lane was given: the modeled seconds per collective kind, and (CPU) its busy intervals."""

    seconds: dict[str, float] = field(default_factory=dict)
    intervals: list[tuple[float, float]] = field(default_factory=list)  # time.monotonic() start, end (CPU lanes)

    def add(self, op: str, seconds: float) -> None:
        self.seconds[op] = self.seconds.get(op, 0.0) + seconds


class _UntilWork(dist.Work):
    """A collective that completes at `end` (time.monotonic()): `wait()` sleeps until then."""

    def __init__(self, end: float, result: Any) -> None:
        super().__init__()
        self._end, self._result = end, result

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (torch's signature)
        remaining = self._end - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return True

    def is_completed(self) -> bool:
        return time.monotonic() >= self._end

    def get_future(self) -> Future:
        self.wait()
        future = Future()
        future.set_result(self._result)
        return future


class HostLane:
    """A CPU group's lane: a clock (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until = 0.0
        self.log = LaneLog()

    def submit(self, op: str, move: Callable[[], None], seconds: float, result: Any,
               tensors: Sequence[torch.Tensor]) -> dist.Work:
        move()
        with record_function(LANE_RANGE + self.name):
            start = max(time.monotonic(), self.busy_until)
            self.busy_until = start + seconds
        self.log.add(op, seconds)
        self.log.intervals.append((start, self.busy_until))
        return _UntilWork(self.busy_until, result)


class CudaLane:
    """A CUDA group's lane: a stream held by a calibrated spin kernel (module docstring)."""

    def __init__(self, name: str, device: torch.device, cycles_per_second: float) -> None:
        self.name, self.device = name, device
        self.stream = torch.cuda.Stream(device)
        self.cycles_per_second = cycles_per_second
        self.log = LaneLog()

    def submit(self, op: str, move: Callable[[], None], seconds: float, result: Any,
               tensors: Sequence[torch.Tensor]) -> dist.Work:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # its inputs are ready
        with torch.cuda.stream(self.stream):
            move()
            if seconds > 0:
                with record_function(LANE_RANGE + self.name):
                    torch.cuda._sleep(max(1, round(seconds * self.cycles_per_second)))
            for tensor in tensors:  # the allocator must not hand their memory out before the lane is done
                if tensor.is_cuda:
                    tensor.record_stream(self.stream)
            future = Future(devices=[self.device])
            future.set_result(result)  # records an event on the lane; wait() makes the caller's stream wait on it
        self.log.add(op, seconds)
        return _create_work_from_future(future)


def spin_cycles_per_second(device: torch.device, cycles: int = 20_000_000) -> float:
    """The rate of `torch.cuda._sleep` on `device`, timed with CUDA events (after one warm-up)."""
    torch.cuda._sleep(cycles // 10)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


class LinkEmulator:
    """The lanes of this process's loopback groups, made on each group's first collective; `label` names a
    group's lane from its group name and global ranks (default: the group name)."""

    def __init__(self, links: Links, device: torch.device,
                 label: Callable[[str, list[int]], str] | None = None) -> None:
        self.links, self.device = links, device
        self._label = label or (lambda name, ranks: name)
        self._rate = spin_cycles_per_second(device) if device.type == "cuda" else None
        self.lanes: dict[int, HostLane | CudaLane] = {}  # id(group) -> its lane
        self.ranks: dict[int, list[int]] = {}  # id(group) -> its global ranks
        self.names: dict[int, str] = {}  # id(group) -> its group name

    def lane(self, group: dist.ProcessGroup) -> HostLane | CudaLane:
        key = id(group)
        if key not in self.lanes:
            self.ranks[key] = dist.get_process_group_ranks(group)
            self.names[key] = group.group_name
            name = self._label(group.group_name, self.ranks[key])
            self.lanes[key] = HostLane(name) if self._rate is None else CudaLane(name, self.device, self._rate)
        return self.lanes[key]

    def seconds(self, group: dist.ProcessGroup, op: str, received: int) -> float:
        return collective_seconds(op, received, self.ranks[id(group)], self.links)

    def seconds_by_group(self) -> dict[str, tuple[list[int], dict[str, float]]]:
        """Group name -> its global ranks and the modeled seconds its lane was given so far, by
        collective kind."""
        return {self.names[key]: (self.ranks[key], dict(lane.log.seconds)) for key, lane in self.lanes.items()}

    def busiest_seconds(self) -> float:
        """The most modeled seconds any one lane was given so far."""
        return max((sum(lane.log.seconds.values()) for lane in self.lanes.values()), default=0.0)


_ACTIVE: list[LinkEmulator] = []  # the emulator loopback groups use now (at most one)


def active_emulator() -> LinkEmulator | None:
    return _ACTIVE[0] if _ACTIVE else None


@contextmanager
def emulated_links(links: Links, device: torch.device,
                   label: Callable[[str, list[int]], str] | None = None) -> Iterator[LinkEmulator]:
    """Loopback collectives inside the block take `links`' time on their group's lane (`label`: as
    `LinkEmulator`'s)."""
    assert not _ACTIVE, "one link emulator at a time"
    emulator = LinkEmulator(links, device, label)
    _ACTIVE.append(emulator)
    try:
        yield emulator
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # no lane still holds tensors when the block's caller frees them
        _ACTIVE.clear()
