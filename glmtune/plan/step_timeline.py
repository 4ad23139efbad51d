"""What a profiled step's GPU timeline says about overlap: `rank{R}_timeline.txt` of
`glmtune plan --measure --emulate-links --profile DIR --profile-phase emulated`.

The kernel tables (`step_profile.py`) say where the compute stream's time goes; they cannot say
whether the expert all-to-all was hidden, because the link emulator's lanes (`link_emulator.py`) hold
their streams with a spin kernel beside that compute. Read as intervals on one clock:

  * the compute stream's busy time C (the stream with the most kernel time among those that hold no
    spin kernel: the lanes carry the stand-ins' copies as well);
  * the lanes' hold L (the union of every spin kernel: a collective's modeled transfer);
  * hidden = L ∩ C: transfer time with the rank computing beside it;
  * exposed = L − C: the compute stream idle while a transfer holds a lane (the schedule waits on it);
  * idle = the window − (C ∪ L): neither computing nor transferring — the host is behind (launches,
    a host sync, Python) or the stream waits on something no lane models.

The same figures are given for each kind of pipeline action (the schedule's `PP:` ranges: `F`, `B`,
`OVERLAP_F_B` ...), each action's span being that of the compute kernels it launched (a kernel belongs
to the action whose host range holds its launch), with the host's synchronizations (`cuda*Synchronize`
calls: a `.cpu()`, a `.tolist()`) inside the action's host range. Without a pipeline there is one row,
the whole window.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

from glmtune.plan.profile_sources import launches

SPIN = re.compile(r"spin_kernel")  # torch.cuda._sleep's kernel: a lane's modeled transfer
SYNC = re.compile(r"^cuda\w*Synchronize$")
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


def intersection(a: Intervals, b: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _figures(compute: Intervals, lanes: Intervals, within: Intervals) -> dict[str, float]:
    """Seconds of busy, held, hidden, exposed and idle time inside `within`."""
    busy, held = intersection(compute, within), intersection(lanes, within)
    hidden = length(intersection(busy, held))
    either = length(busy) + length(held) - hidden
    return {"span": length(within), "compute": length(busy), "lane_hold": length(held), "hidden": hidden,
            "exposed": length(held) - hidden, "idle": length(within) - either}


def action_kind(name: str) -> str | None:
    """The kind of a pipeline schedule's range ("PP:0F3" -> "F", "PP:(0F3;1B2)OVERLAP_F_B" ->
    "OVERLAP_F_B"), or None for a range that is not the schedule's."""
    match = _ACTION.match(name)
    return match["kind"] if match else None


def compute_stream(kernels: list[Kernel]) -> Any:
    lanes = {k.stream for k in kernels if SPIN.search(k.name)}
    time: dict[Any, float] = defaultdict(float)
    for k in kernels:
        if k.stream not in lanes:
            time[k.stream] += k.end - k.start
    return max(time, key=time.get) if time else None


def timeline(kernels: list[Kernel], actions: list[HostRange], syncs: list[HostRange], steps: int) -> dict[str, Any]:
    """The module docstring's figures, seconds per step: "whole" (the window from the first kernel to
    the last) and per action kind; "syncs" and "sync_seconds" are the host's synchronizations."""
    stream = compute_stream(kernels)
    if stream is None:
        return {"compute_stream": None, "whole": {}, "actions": {}}
    ours = [k for k in kernels if k.stream == stream]
    compute = merged((k.start, k.end) for k in ours)
    lanes = merged((k.start, k.end) for k in kernels if SPIN.search(k.name))
    window = [(min(k.start for k in kernels), max(k.end for k in kernels))]
    per_step = 1e6 * steps

    def scaled(figures: dict[str, float]) -> dict[str, float]:
        return {name: value / per_step for name, value in figures.items()}

    whole = scaled(_figures(compute, lanes, window))
    whole.update(syncs=len(syncs) / steps, sync_seconds=sum(s.end - s.start for s in syncs) / per_step)
    ranges = sorted((a for a in actions if action_kind(a.name)), key=lambda a: a.start)
    spans: dict[int, list[float]] = {}
    starts = [a.start for a in ranges]
    for k in ours:
        index = _holder(starts, ranges, k.launched)
        if index is not None:
            span = spans.setdefault(index, [k.start, k.end])
            span[0], span[1] = min(span[0], k.start), max(span[1], k.end)
    per_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({action_kind(a.name) for a in ranges}):
        indices = [i for i, a in enumerate(ranges) if action_kind(a.name) == kind]
        within = merged(tuple(spans[i]) for i in indices if i in spans)
        hosts = [ranges[i] for i in indices]
        held_up = [s for s in syncs if any(h.start <= s.start < h.end for h in hosts)]
        row = scaled(_figures(compute, lanes, within))
        row.update(actions=len(indices) / steps, host=sum(h.end - h.start for h in hosts) / per_step,
                   syncs=len(held_up) / steps, sync_seconds=sum(s.end - s.start for s in held_up) / per_step)
        per_kind[kind] = row
    return {"compute_stream": str(stream), "whole": whole, "actions": per_kind}


def _holder(starts: list[float], ranges: list[HostRange], launched: float | None) -> int | None:
    """The index of the range holding `launched` (ranges sorted by start, not overlapping)."""
    if launched is None:
        return None
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= launched:
            lo = mid + 1
        else:
            hi = mid
    index = lo - 1
    return index if index >= 0 and launched < ranges[index].end else None


COLUMNS = ("actions", "host", "span", "compute", "lane_hold", "hidden", "exposed", "idle", "syncs", "sync_seconds")


def timeline_table(figures: dict[str, Any]) -> str:
    """The rows as fixed-width text, seconds per step."""
    head = f"{'':<14}" + "".join(f"{c:>13}" for c in COLUMNS)
    lines = [f"compute stream {figures['compute_stream']}; seconds per step (actions and syncs: counts per step)",
             head]
    rows = [("whole step", figures["whole"])] + sorted(figures["actions"].items())
    for name, row in rows:
        cells = "".join(f"{row[c]:>13.4f}" if c in row else f"{'':>13}" for c in COLUMNS)
        lines.append(f"{name:<14}{cells}")
    return "\n".join(lines) + "\n"


def records(prof) -> tuple[list[Kernel], list[HostRange], list[HostRange]]:
    """(kernels, the schedule's action ranges, host synchronizations) of a CUDA profile."""
    events = prof.events()
    launched_by = launches(prof, events)
    host_start = {e.id: e.time_range.start for e in events if e.device_type == DeviceType.CPU}
    kernels, actions, syncs = [], [], []
    for e in events:
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            kernels.append(Kernel(e.name, e.device_resource_id, e.time_range.start, e.time_range.end,
                                  host_start.get(launched_by.get(e.id))))
        elif e.device_type == DeviceType.CPU and e.is_user_annotation and action_kind(e.name):
            actions.append(HostRange(e.name, e.time_range.start, e.time_range.end))
        elif e.device_type == DeviceType.CPU and SYNC.match(e.name):
            syncs.append(HostRange(e.name, e.time_range.start, e.time_range.end))
    return kernels, actions, syncs
