"""Where a profiled step's kernel time comes from in glmtune's code: `rank{R}_sources.txt` of
`glmtune plan --measure --profile DIR`.

The kernel table says *what* ran (`aten::copy_` 0.42 s); a fix needs to know *which function* of
the model asked for it. (The profiler names a frame by the line its function starts at, not the
line running: a site is a function, `attention.py(263): _absorbed_attend`.) Each kernel on the
compute stream (each CPU operator's own time on a CPU) is charged to:

  * its operator: the outermost aten operator above the one that launched it (`aten::cat`, not the
    `aten::copy_` inside it), or the custom op (`glmtune::sparse_mla`);
  * its phase and site:
      forward    the innermost glmtune frame of the Python stack that called the operator
                 (`glmtune/models/glm5/attention.py(263): _absorbed_attend`);
      recompute  the same, for activation checkpointing's second forward (the stack runs through
                 torch.utils.checkpoint's recomputation, inside the backward);
      backward   the forward site of the autograd node that runs it (the node's sequence number
                 is the forward operator's), with the node's name (`[CatBackward0]`); code of a
                 custom backward (a glmtune frame inside the node) is its own site;
      optimizer  the optimizer's step (torch.optim's or glmtune's AdamW on the stack).

It needs the profiler's Python stacks (`with_stack=True`, which `profiled` turns on). From torch
2.12 the profile's events hold the Python frames, each the parent of what it called; torch 2.11's
(the GPU image's) hold none, so there each operator's frames are read from the profiler's event
tree (`tree_frames`) and put back between it and its parent operator (`_chain`): both give the
same rows (tested). A kernel whose operator cannot be found (a side stream's, an allocator's) is
charged to "?". Rows are (kind, phase, operator, site), heaviest first.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

from glmtune.plan.kernel_kinds import kind_of

BACKWARD_NODE = "autograd::engine::evaluate_function: "
# A Python frame event's name: "path/to/file.py(123): function"; glmtune's own, from the package root.
_FRAME = re.compile(r"^(?P<path>.*\.py)\((?P<line>\d+)\): (?P<function>.*)$")
# The last "glmtune/" of the path whose rest is a package path (not a checkout's venv or site-packages).
_GLMTUNE = re.compile(r"(?:^|.*/)(glmtune/(?:(?!\.venv/|site-packages/)[^/]+/)*[^/]+\.py)$")
_RECOMPUTE = re.compile(r"torch/utils/checkpoint\.py\(\d+\): (?:recompute_fn|unpack_hook|_checkpoint_hook)")
_OPTIMIZER = re.compile(r"torch/optim/.*\.py\(|glmtune/kernels/adamw\.py\(|glmtune/train/optim\.py\(")
_AUTOGRAD_FUNCTION = re.compile(r"Backward\d*$")  # the record of a node's function, under its evaluate_function
ROWS = 60


@dataclass(frozen=True)
class Source:
    kind: str
    phase: str  # forward, recompute, backward, optimizer, other (no glmtune frame on its stack)
    operator: str
    site: str


def is_python_frame(name: str) -> bool:
    """Whether a profiler event's name is a Python frame's (a function, a builtin), not an operator's."""
    return bool(_FRAME.match(name)) or name.startswith(("<built-in", "<frozen", "<method"))


def _glmtune_frame(name: str) -> str | None:
    frame = _FRAME.match(name)
    if frame is None:
        return None
    inside = _GLMTUNE.search(frame["path"])
    return None if inside is None else f"{inside[1]}({frame['line']}): {frame['function']}"


def is_frame_event(event) -> bool:
    """Whether a profile event is a Python frame's (torch >= 2.12 records them as events)."""
    return getattr(event, "is_python_function", False)


def holds_frames(events) -> bool:
    """Whether a profile's events hold its Python frames (torch >= 2.12), or only its event tree does."""
    return any(map(is_frame_event, events))


@dataclass(frozen=True)
class _Frame:
    """A Python frame of the event tree, standing in an operator's chain as an event would."""
    name: str
    is_user_annotation: bool = False


Frames = dict[int, tuple[str, ...]]  # operator event id -> its Python frames, innermost first


def tree_frames(prof) -> Frames:
    """Each operator's enclosing Python frames, innermost first, keyed by its event's id: from the
    profiler's event tree (`experimental_event_tree`, where the frames are nodes above the operators
    they called, in every torch that records them)."""
    frames: Frames = {}
    pending = [(root, ()) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while pending:
        node, above = pending.pop()  # above: the Python frames over `node`, innermost first
        tag = str(node.tag)
        if tag.endswith(("PyCall", "PyCCall")):
            above = (node.name, *above)
        elif tag.endswith("TorchOp"):
            frames[node.correlation_id] = above
        pending.extend((child, above) for child in node.children)
    return frames


def _chain(event, frames: Frames | None = None) -> list:
    """`event`'s ancestors, innermost first: operators and Python frames. With `frames` (a torch 2.11
    profile) the tree's frames go between each operator and its parent operator."""
    chain, parent = [], event.cpu_parent
    if frames is None:
        while parent is not None:
            chain.append(parent)
            parent = parent.cpu_parent
        return chain
    current = event
    while current is not None:
        while parent is not None and is_frame_event(parent):
            parent = parent.cpu_parent  # a newer torch's own frames: the tree's stand in for them
        own, outer = frames.get(current.id, ()), frames.get(parent.id, ()) if parent is not None else ()
        chain.extend(_Frame(name) for name in own[:max(len(own) - len(outer), 0)])
        if parent is not None:
            chain.append(parent)
        current, parent = parent, parent.cpu_parent if parent is not None else None
    return chain


def _outer_operator(event, chain: list) -> str:
    """The outermost operator above `event` before the first Python frame or autograd node."""
    name = event.name
    for ancestor in chain:
        if (is_python_frame(ancestor.name) or ancestor.name.startswith(BACKWARD_NODE) or ancestor.is_user_annotation
                or _AUTOGRAD_FUNCTION.search(ancestor.name)):
            break
        name = ancestor.name
    return name


def forward_sites(events, frames: Frames | None = None) -> dict[tuple[int, int], str]:
    """(thread, sequence number) of each forward operator that recorded an autograd node -> its site."""
    sites: dict[tuple[int, int], str] = {}
    for event in sorted(events, key=lambda e: e.time_range.start):
        if event.device_type != DeviceType.CPU or event.sequence_nr < 0 or is_frame_event(event):
            continue
        key = (event.thread, event.sequence_nr)
        if key in sites:
            continue  # the outermost operator of the node came first
        chain = _chain(event, frames)
        if any(a.name.startswith(BACKWARD_NODE) for a in chain):
            continue  # a recomputation or a backward: not the node's forward
        site = next((f for f in map(_glmtune_frame, (a.name for a in chain)) if f), None)
        if site is not None:
            sites[key] = site
    return sites


def phase_and_site(event, sites: dict[tuple[int, int], str], frames: Frames | None = None) -> tuple[str, str]:
    """(phase, site) of an operator event (module docstring)."""
    site, recompute = None, False
    chain = [event, *_chain(event, frames)]  # an autograd node's own event (its time on a CPU) is in its node
    if any(_OPTIMIZER.search(a.name) for a in chain):
        return "optimizer", next((f for f in map(_glmtune_frame, (a.name for a in chain)) if f), "?")
    for ancestor in chain:
        if ancestor.name.startswith(BACKWARD_NODE):
            node = ancestor.name[len(BACKWARD_NODE):]
            if recompute:
                return "recompute", site or "?"
            if site is not None:
                return "backward", f"{site} [{node}]"
            forward = sites.get((ancestor.fwd_thread, ancestor.sequence_nr))
            return "backward", f"{forward or '?'} [{node}]"
        if site is None:
            site = _glmtune_frame(ancestor.name)
        recompute = recompute or bool(_RECOMPUTE.search(ancestor.name))
    return ("forward", site) if site is not None else ("other", "?")


def timed_events(prof, on_device: bool) -> list[tuple[Any, Any, float]]:
    """(event, stream, own microseconds) of each kernel (on a device) or CPU operator: the time a profile
    counts (`step_profile.summarize`) and charges here."""
    events = []
    for event in prof.events():
        # a range a caller marked (record_function: the pipeline schedule's "PP:..." ranges, shown on the
        # device's timeline too) spans kernels counted on their own: counting it would count them twice
        if event.is_user_annotation:
            continue
        if on_device and event.device_type == DeviceType.CUDA:
            events.append((event, event.device_resource_id, event.time_range.elapsed_us()))
        elif not on_device and event.device_type == DeviceType.CPU and not is_frame_event(event):
            # its own time, its children's excluded: each microsecond counted once, under the
            # operator that spent it (aten::mm, not the autograd node that called it)
            events.append((event, "cpu", event.self_cpu_time_total))
    return events


def launches(prof, events) -> dict[int, int]:
    """Device event id -> the id of the CPU operator that launched it: the events' `linked_correlation_id`,
    or, for a torch (2.11) whose events do not carry it, the profiler's own records of the same events."""
    if events and hasattr(events[0], "linked_correlation_id"):
        return {e.id: e.linked_correlation_id for e in events if e.device_type != DeviceType.CPU}
    return {record.correlation_id(): record.linked_correlation_id()
            for record in prof.profiler.kineto_results.events() if record.device_type() != DeviceType.CPU}


def sources(prof, on_device: bool, stream, steps: int, frames: Frames | None = None) -> list[dict[str, Any]]:
    """Seconds per step and share of each (kind, phase, operator, site), heaviest first, on `stream`.
    The Python frames come from the profile's events where they hold them, else from its event tree
    (`tree_frames`; torch 2.11); `frames` given are used instead of either."""
    events = prof.events()
    if frames is None and not holds_frames(events):
        frames = tree_frames(prof)
    sites = forward_sites(events, frames)
    launcher = {e.id: e for e in events if e.device_type == DeviceType.CPU} if on_device else {}
    launched_by = launches(prof, events) if on_device else {}
    charged: dict[int, tuple[str, str, str]] = {}  # operator event id -> (phase, operator, site): one walk each
    seconds: dict[Source, float] = defaultdict(float)
    for event, event_stream, micros in timed_events(prof, on_device):
        if str(event_stream) != str(stream):
            continue
        operator = launcher.get(launched_by.get(event.id)) if on_device else event
        if operator is None:
            key = Source(kind_of(event.name), "other", "?", "?")
        else:
            if operator.id not in charged:
                phase, site = phase_and_site(operator, sites, frames)
                charged[operator.id] = (phase, _outer_operator(operator, _chain(operator, frames)), site)
            phase, name, site = charged[operator.id]
            key = Source(kind_of(event.name), phase, name, site)
        seconds[key] += micros / 1e6 / steps
    total = sum(seconds.values()) or 1.0
    rows = sorted(seconds.items(), key=lambda item: -item[1])
    return [{"seconds_per_step": s, "share": s / total, "kind": k.kind, "phase": k.phase, "operator": k.operator,
             "site": k.site} for k, s in rows]


def sources_table(rows: list[dict[str, Any]], limit: int = ROWS) -> str:
    """The heaviest `limit` rows as fixed-width text."""
    lines = [f"{'s/step':>8} {'share':>6}  {'kind':<22} {'phase':<9} {'operator':<32} site"]
    for row in rows[:limit]:
        lines.append(f"{row['seconds_per_step']:8.4f} {row['share']:6.1%}  {row['kind']:<22} {row['phase']:<9} "
                     f"{row['operator'][:32]:<32} {row['site']}")
    return "\n".join(lines) + "\n"
