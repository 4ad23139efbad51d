"""`glmtune plan RECIPE --measure --profile DIR`: the timed steps of the measured rank under
torch.profiler, written as tables a reader can compare across ranks and commits.

What the profile holds and why:

  * `rank{R}_kernels.txt`: the heaviest kernels (CUDA) or operators (CPU) by their own time,
    torch's `key_averages` table — where the step's time goes, by name;
  * `rank{R}_summary.json`: device time per stream and, for the busiest stream (the rank's own
    compute: the link emulator's lanes and the stand-ins' copies run on side streams), time per
    kind of work: GEMMs, attention, copies and gathers, elementwise and the rest, each as seconds
    per step and a share; on a CPU the operators' own time (children's excluded), one "stream";
  * `rank{R}_sources.txt`: the same time charged to the glmtune function that asked for it, by
    phase (forward, recompute, backward) and operator (`profile_sources.py`): which concatenation,
    which copy;
  * `rank{R}_trace.json`: the Chrome trace (chrome://tracing, Perfetto) for the timeline;
  * on a GPU, `rank{R}_timeline.txt`: the compute stream's busy time beside the emulated links' lanes,
    whole and per pipeline action (`step_timeline.py`): what was hidden, what was exposed, and where
    neither computed — of the emulated steps, with `--profile-phase emulated`.

The kinds are matched by kernel name (`kernel_kinds.KINDS`, first match wins): an estimate of where time goes
that names what it counted, not an exact attribution (a fused kernel counts once, in its first kind).
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

from glmtune.plan.kernel_kinds import KINDS, kind_of
from glmtune.plan.profile_sources import is_python_frame, sources, sources_table
from glmtune.plan.profile_sources import timed_events as profile_events  # with their events
from glmtune.plan.step_timeline import compute_stream, records, timeline, timeline_table

TABLE_ROWS = 40
# Why the emulated steps' profile has no sources table: the timeline measures the host's pace against the GPU's,
# and recording every operator's Python stack slows the host (a profiled sft_4k rank: 5.68 s against 4.92).
NO_STACKS = ("the emulated steps are profiled without Python stacks, which would slow the host whose pace the "
             "timeline shows")
SUMMARY_SOURCES = 25  # the heaviest (kind, phase, operator, site) rows, also in the summary


# torch's profiler keeps a Python frame's name as a pointer into its code object and reads it when
# the results are parsed, after the block: a module imported inside the block has run its body's
# code object and freed it by then (a UnicodeDecodeError on a dangling name, pytorch#64345). The
# audit hook keeps every code object `exec` runs while a profile is open, until the profile is
# dropped. (An audit hook cannot be removed: it is installed once and does nothing between profiles.)
_KEPT_CODE: list | None = None


def _keep_exec_code(event: str, args: tuple) -> None:
    if event == "exec" and _KEPT_CODE is not None:
        _KEPT_CODE.append(args[0])


@functools.cache
def _install_code_keeper() -> None:
    sys.addaudithook(_keep_exec_code)


@contextmanager
def profiled(device: torch.device, with_stack: bool = True) -> Iterator[profile]:
    """torch.profiler over the block: CPU operators, and CUDA kernels on a GPU; with the Python stacks
    unless `with_stack` is False (`profile_sources` charges each kernel's time to them; they add CPU time,
    not kernel time, which the emulated steps' timeline must not feel: `NO_STACKS`). The
    code objects run by `exec` inside the block live as long as the profile (`_KEPT_CODE`)."""
    global _KEPT_CODE
    _install_code_keeper()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _KEPT_CODE = []
    try:
        with profile(activities=activities, record_shapes=False, with_stack=with_stack) as prof:
            yield prof
    finally:
        kept, _KEPT_CODE = _KEPT_CODE, None
    prof.glmtune_kept_code = kept  # dropped with the profile, after its results are parsed
    prof.glmtune_stacks = with_stack
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_events(prof: profile, on_device: bool) -> list[tuple[str, Any, float]]:
    """(name, stream, own microseconds) of each kernel (on a device) or CPU operator
    (`profile_sources.timed_events`, which the sources table charges)."""
    return [(event.name, stream, micros) for event, stream, micros in profile_events(prof, on_device)]


def summarize(prof: profile, on_device: bool, steps: int) -> dict[str, Any]:
    """Seconds per step per stream, and per kind on the busiest stream (module docstring)."""
    per_stream: dict[Any, float] = defaultdict(float)
    per_kind: dict[Any, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    timed = timed_events(prof, on_device)
    for name, stream, micros in timed:
        per_stream[stream] += micros
        per_kind[stream][kind_of(name)] += micros
    busiest = compute_stream(timed)  # not an emulated link's lane, whose spin kernels are modeled transfers
    if busiest is None:
        return {"steps": steps, "streams": {}, "compute_stream": None, "kinds": {}}
    total = per_stream[busiest]
    kinds = {kind: {"seconds_per_step": per_kind[busiest][kind] / 1e6 / steps,
                    "share": per_kind[busiest][kind] / total if total else 0.0}
             for kind, _ in KINDS}
    return {"steps": steps, "what": "CUDA kernel time" if on_device else "CPU operators' own time",
            "streams": {str(s): seconds / 1e6 / steps for s, seconds in per_stream.items()},
            "compute_stream": str(busiest), "kinds": kinds}


def write_profile(prof: profile, out_dir: Path, rank: int, on_device: bool, steps: int) -> dict[str, Any]:
    """The four files of the module docstring into `out_dir`; the summary."""
    sort_by = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    # The Python frames' events (the stacks) are not operators: left out of the table.
    operators = EventList([row for row in prof.key_averages() if not is_python_frame(row.key)],
                          use_device="cuda" if on_device else None)
    table = operators.table(sort_by=sort_by, row_limit=TABLE_ROWS, max_name_column_width=90)
    (out_dir / f"rank{rank}_kernels.txt").write_text(table + "\n", encoding="utf-8")
    summary = summarize(prof, on_device, steps)
    if not getattr(prof, "glmtune_stacks", True):
        (out_dir / f"rank{rank}_sources.txt").write_text(
            f"not attributed: {NO_STACKS}\n", encoding="utf-8")
    elif summary["compute_stream"] is not None:
        try:
            rows = sources(prof, on_device, summary["compute_stream"], steps)
        except Exception as exc:  # noqa: BLE001 - an attribution that fails must not cost the tables beside it
            summary["sources_error"] = f"{type(exc).__name__}: {exc}"
            (out_dir / f"rank{rank}_sources.txt").write_text(f"not attributed: {summary['sources_error']}\n",
                                                              encoding="utf-8")
        else:
            (out_dir / f"rank{rank}_sources.txt").write_text(sources_table(rows), encoding="utf-8")
            summary["sources"] = rows[:SUMMARY_SOURCES]
    if on_device:
        try:
            kernels, actions, calls, lanes = records(prof)
            summary["timeline"] = timeline(kernels, actions, calls, steps, lanes)
        except Exception as exc:  # noqa: BLE001 - as the sources: the other tables are kept
            summary["timeline_error"] = f"{type(exc).__name__}: {exc}"
        text = (timeline_table(summary["timeline"]) if "timeline" in summary
                else f"not read: {summary['timeline_error']}\n")
        (out_dir / f"rank{rank}_timeline.txt").write_text(text, encoding="utf-8")
    (out_dir / f"rank{rank}_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    prof.export_chrome_trace(str(out_dir / f"rank{rank}_trace.json"))
    return summary
