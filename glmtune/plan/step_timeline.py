"""What a profiled step's GPU timeline says about overlap: `rank{R}_timeline.txt` of
`glmtune plan --measure --emulate-links --profile DIR --profile-phase emulated`.

The kernel tables (`step_profile.py`) say where the compute stream's time goes; they cannot say
whether the expert all-to-all was hidden, because the link emulator's lanes (`link_emulator.py`) hold
their streams with a spin kernel beside that compute. Read as intervals on one clock — the compute
stream (the stream with the most kernel time among those that hold no spin kernel: the lanes carry the
stand-ins' copies as well) and the lanes' hold (every spin kernel: a collective's modeled transfer) —
the window from the first kernel to the last is cut at the compute stream's kernels, and each piece is
charged to the kernel that ends it (`_charged`):

  * compute: the kernel's own time; hidden: the lanes' hold beside it;
  * the gap before it, when the stream sat idle:
      wait_host   the kernel's operator started after the gap began: the host had not launched it yet
                  (Python, launches, a host sync, the other side's turn);
      wait_link   launched in time, with a lane holding: the stream waits for a transfer — the
                  exposed communication proper;
      wait_other  launched in time, no lane holding (a dependency no lane models).

Each lane apart (`_lanes`): its hold, the part of it beside the compute stream's kernels (hidden) and
the rest (held while the stream sat idle), a lane named by the profiler range around its spin kernels
(`link_emulator.LANE_RANGE`: the group's mesh axes, `ep`, `dp_shard`, `pp`), so FSDP2's
gathers and reduce-scatters are seen hidden or not, apart from the expert all-to-all.

Each piece goes to the kind of pipeline action that launched the kernel (the schedule's `PP:` ranges:
`F`, `B`, `OVERLAP_F_B`, ...; a kernel belongs to the action whose host range holds the start of its
launching operator, "other" when none does), so the kinds' rows add up to the whole window; beside them
each kind's actions, host time and host synchronizations inside its host ranges; and last, the host's
heaviest CUDA calls by time (a launch that waits for room in the queue means the GPU is behind; an
allocator's synchronizing free, a sync, show there). A copy call is named with the copy it made
("cudaMemcpyAsync DtoH (Device -> Pageable)"). The synchronizations are the `cuda*Synchronize` calls and
the copies to pageable host memory: a `.cpu()` or `.tolist()` of a device tensor copies into pageable
memory, and that copy returns only once every kernel queued before it has run, so its wait is in the
copy's call, not in the `cudaStreamSynchronize` that follows it. An operator starts before it launches
its kernel, so `wait_host` is a lower bound: a kernel launched late inside a long operator counts as
launched in time.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

from glmtune.distributed.link_emulator import LANE_RANGE
from glmtune.plan.profile_sources import launches

SPIN = re.compile(r"spin_kernel")  # torch.cuda._sleep's kernel: a lane's modeled transfer
SYNC = re.compile(r"^cuda\w*Synchronize$|^cu\w*Memcpy\w* DtoH \(Device -> Pageable\)$")  # module docstring
CALL = re.compile(r"^cu(?:da)?[A-Z]\w*$")  # a CUDA runtime or driver call: cudaLaunchKernel, cuLaunchKernel
HOST_CALLS = 8  # the heaviest, by host time, in the table
_ACTION = re.compile(r"^PP:(?:\(.*\))?\d*(?P<kind>[A-Z_]+)\d*$")

Intervals = list[tuple[float, float]]  # sorted, disjoint, microseconds


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: Any
    start: float  # microseconds
    end: float
    launched: float | None  # when the host launched it (microseconds), when known


@dataclass(frozen=True)
class HostRange:
    name: str
    start: float
    end: float


def merged(spans: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def held_within(lanes: Intervals, lane_starts: list[float], start: float, end: float) -> float:
    """The length of `lanes` inside [start, end]; `lane_starts` is their starts (a bisection, not a walk:
    a step has hundreds of thousands of kernels)."""
    i = max(bisect.bisect_right(lane_starts, start) - 1, 0)
    held = 0.0
    while i < len(lanes) and lanes[i][0] < end:
        held += max(0.0, min(lanes[i][1], end) - max(lanes[i][0], start))
        i += 1
    return held


def action_kind(name: str) -> str | None:
    """The kind of a pipeline schedule's range ("PP:0F3" -> "F", "PP:(0F3;1B2)OVERLAP_F_B" ->
    "OVERLAP_F_B"), or None for a range that is not the schedule's."""
    match = _ACTION.match(name)
    return match["kind"] if match else None


def compute_stream(timed: Iterable[tuple[str, Any, float]]) -> Any:
    """The stream with the most kernel time among those that hold no spin kernel, of (name, stream,
    time) triples; None without one. An emulated link's lane can hold its stream longer than the rank
    computes, so the busiest stream is not always the compute stream."""
    lanes, time = set(), defaultdict(float)
    for name, stream, duration in timed:
        time[stream] += duration
        if SPIN.search(name):
            lanes.add(stream)
    computing = [stream for stream in time if stream not in lanes]
    return max(computing, key=time.get) if computing else None


def timeline(kernels: list[Kernel], actions: list[HostRange], calls: list[HostRange], steps: int,
             lane_ranges: list[HostRange | Kernel] = ()) -> dict[str, Any]:
    """The module docstring's figures, seconds per step: "whole" and per action kind (`_charged`);
    "syncs" and "sync_seconds" are the host's synchronizations among its CUDA `calls` (inside the kind's
    host ranges); "host_calls" the heaviest calls by host time (a launch that waits for room in the
    launch queue, an allocator's synchronizing free, show there); "lanes" each lane's hold and the part
    of it hidden (`_lanes`, named from `lane_ranges`)."""
    syncs = [c for c in calls if SYNC.match(c.name)]
    stream = compute_stream((k.name, k.stream, k.end - k.start) for k in kernels)
    if stream is None:
        return {"compute_stream": None, "whole": {}, "actions": {}, "host_calls": {}, "lanes": {}}
    lanes = merged((k.start, k.end) for k in kernels if SPIN.search(k.name))
    window = (min(k.start for k in kernels), max(k.end for k in kernels))
    ranges = sorted((a for a in actions if action_kind(a.name)), key=lambda a: a.start)
    charged = _charged(sorted((k for k in kernels if k.stream == stream), key=lambda k: k.start), lanes,
                       window, ranges)
    per_step = 1e6 * steps
    per_kind: dict[str, dict[str, float]] = {}
    for kind, row in charged.items():
        hosts = [a for a in ranges if action_kind(a.name) == kind]
        held_up = [s for s in syncs if any(h.start <= s.start < h.end for h in hosts)]
        per_kind[kind] = {name: value / per_step for name, value in row.items()}
        per_kind[kind].update(actions=len(hosts) / steps, host=sum(h.end - h.start for h in hosts) / per_step,
                              syncs=len(held_up) / steps, sync_seconds=sum(s.end - s.start for s in held_up) / per_step)
    whole = {name: sum(row[name] for row in per_kind.values()) for name in CHARGES}
    whole.update(span=(window[1] - window[0]) / per_step, lane_hold=length(lanes) / per_step,
                 syncs=len(syncs) / steps, sync_seconds=sum(s.end - s.start for s in syncs) / per_step)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for c in calls:
        by_name[c.name][0] += 1
        by_name[c.name][1] += c.end - c.start
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][1])[:HOST_CALLS]
    host_calls = {name: {"count": n / steps, "seconds": micros / per_step} for name, (n, micros) in heaviest}
    return {"compute_stream": str(stream), "whole": whole, "actions": per_kind, "host_calls": host_calls,
            "lanes": _lanes(kernels, stream, lane_ranges, per_step)}


def _lanes(kernels: list[Kernel], stream: Any, lane_ranges: list[HostRange | Kernel], per_step: float
           ) -> dict[str, dict[str, float]]:
    """Lane name -> its hold ("held": its spin kernels' union) and "hidden" (the part beside the compute
    `stream`'s kernels), per step. A lane (a stream of spin kernels) is named by a lane range the profiler
    recorded on that stream (a `Kernel`: the range's device side), else by the host lane range holding a
    spin kernel's launch, else "stream <id>"; lanes of one name add up."""
    busy = merged((k.start, k.end) for k in kernels if k.stream == stream)
    busy_starts = [start for start, _ in busy]
    on_device = {r.stream: r.name.removeprefix(LANE_RANGE) for r in lane_ranges if isinstance(r, Kernel)}
    ranges = sorted((r for r in lane_ranges if isinstance(r, HostRange)), key=lambda r: r.start)
    starts = [r.start for r in ranges]
    spans: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    names: dict[Any, str] = {}
    for k in kernels:
        if SPIN.search(k.name):
            spans[k.stream].append((k.start, k.end))
            index = None if k.stream in names else _holder(starts, ranges, k.launched)
            if index is not None:
                names[k.stream] = ranges[index].name.removeprefix(LANE_RANGE)
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"held": 0.0, "hidden": 0.0})
    for lane, own in spans.items():
        held = merged(own)
        row = rows[on_device.get(lane) or names.get(lane, f"stream {lane}")]
        row["held"] += length(held) / per_step
        row["hidden"] += sum(held_within(busy, busy_starts, start, end) for start, end in held) / per_step
    return dict(rows)


# How each microsecond of the window is charged (`_charged`).
CHARGES = ("compute", "hidden", "wait_link", "wait_host", "wait_other", "tail")


def _charged(ours: list[Kernel], lanes: Intervals, window: tuple[float, float],
             ranges: list[HostRange]) -> dict[str, dict[str, float]]:
    """The window cut at the compute stream's kernels, each piece charged to the action kind that launched
    the kernel ending it ("other" when no schedule range holds its launch): the kernel's own time
    (`compute`, and the lanes' hold beside it, `hidden`), and the gap before it — `wait_host` when the
    kernel's operator started after the gap began (the host had not launched it), else the gap's part
    with a lane holding (`wait_link`: the stream waits for a transfer) and the rest (`wait_other`).
    After the last kernel: `tail`. So the kinds' rows add up to the window."""
    starts, lane_starts = [a.start for a in ranges], [start for start, _ in lanes]
    rows: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(CHARGES, 0.0))
    cursor = window[0]
    for k in ours:
        index = _holder(starts, ranges, k.launched)
        row = rows[action_kind(ranges[index].name) if index is not None else "other"]
        if k.start > cursor:
            if k.launched is not None and k.launched > cursor:
                row["wait_host"] += k.start - cursor
            else:
                held = held_within(lanes, lane_starts, cursor, k.start)
                row["wait_link"] += held
                row["wait_other"] += k.start - cursor - held
        busy = (max(cursor, k.start), k.end)
        if busy[1] > busy[0]:
            row["compute"] += busy[1] - busy[0]
            row["hidden"] += held_within(lanes, lane_starts, *busy)
        cursor = max(cursor, k.end)
    if window[1] > cursor:
        rows["other"]["tail"] += window[1] - cursor
    return dict(rows)


def _holder(starts: list[float], ranges: list[HostRange], launched: float | None) -> int | None:
    """The index of the range holding `launched` (ranges sorted by start, not overlapping)."""
    if launched is None:
        return None
    index = bisect.bisect_right(starts, launched) - 1
    return index if index >= 0 and launched < ranges[index].end else None


COLUMNS = ("actions", "host", "compute", "hidden", "wait_link", "wait_host", "wait_other", "tail", "syncs",
           "sync_seconds")


def timeline_table(figures: dict[str, Any]) -> str:
    """The rows as fixed-width text, seconds per step."""
    head = f"{'':<14}" + "".join(f"{c:>13}" for c in COLUMNS)
    whole = figures["whole"]
    lines = [f"compute stream {figures['compute_stream']}; seconds per step (actions and syncs: counts per step); "
             f"window {whole['span']:.4f}, lanes held {whole['lane_hold']:.4f} (exposed "
             f"{whole['lane_hold'] - whole['hidden']:.4f})", head]
    lanes = "; ".join(f"{name} held {row['held']:.4f}, hidden {row['hidden']:.4f}"
                      f" ({row['hidden'] / row['held'] if row['held'] else 0:.0%})"
                      for name, row in sorted(figures["lanes"].items()))
    lines.insert(1, f"lanes: {lanes or 'none'}")
    rows = [("whole step", figures["whole"])] + sorted(figures["actions"].items())
    for name, row in rows:
        cells = "".join(f"{row[c]:>13.4f}" if c in row else f"{'':>13}" for c in COLUMNS)
        lines.append(f"{name:<14}{cells}")
    calls = ", ".join(f"{name} {c['seconds']:.4f} s ({c['count']:.0f})" for name, c in figures["host_calls"].items())
    lines.append(f"host CUDA calls per step, heaviest: {calls or 'none'}")
    return "\n".join(lines) + "\n"


def records(prof) -> tuple[list[Kernel], list[HostRange], list[HostRange], list[HostRange | Kernel]]:
    """(kernels, the schedule's action ranges, the host's CUDA calls, the links' lane ranges: on the host,
    and as the profiler mirrors a range on the stream its kernels ran on) of a CUDA profile."""
    events = prof.events()
    launched_by = launches(prof, events)
    host_start = {e.id: e.time_range.start for e in events if e.device_type == DeviceType.CPU}
    # A runtime call and the device activity it started share their correlation id, the events' id.
    copies = {e.id: e.name.removeprefix("Memcpy ") for e in events
              if e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy ")}
    kernels, actions, calls, lanes = [], [], [], []
    for e in events:
        if e.device_type == DeviceType.CUDA and e.is_user_annotation and e.name.startswith(LANE_RANGE):
            lanes.append(Kernel(e.name, e.device_resource_id, e.time_range.start, e.time_range.end, None))
        elif e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            kernels.append(Kernel(e.name, e.device_resource_id, e.time_range.start, e.time_range.end,
                                  host_start.get(launched_by.get(e.id))))
        elif e.device_type == DeviceType.CPU and e.is_user_annotation and action_kind(e.name):
            actions.append(HostRange(e.name, e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CPU and e.is_user_annotation and e.name.startswith(LANE_RANGE):
            lanes.append(HostRange(e.name, e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CPU and CALL.match(e.name):
            copy = copies.get(e.id)
            calls.append(HostRange(f"{e.name} {copy}" if copy else e.name, e.time_range.start, e.time_range.end))
    return kernels, actions, calls, lanes
