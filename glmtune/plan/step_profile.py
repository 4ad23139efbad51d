"""`glmtune plan RECIPE --measure --profile DIR`: the timed steps of the measured rank under
torch.profiler, written as tables a reader can compare across ranks and commits.

What the profile holds and why:

  * `rank{R}_kernels.txt`: the heaviest kernels (CUDA) or operators (CPU) by their own time,
    torch's `key_averages` table — where the step's time goes, by name;
  * `rank{R}_summary.json`: device time per stream and, for the busiest stream (the rank's own
    compute: the link emulator's lanes and the stand-ins' copies run on side streams), time per
    kind of work: GEMMs, attention, copies and gathers, elementwise and the rest, each as seconds
    per step and a share; on a CPU the operators' own time (children's excluded), one "stream";
  * `rank{R}_trace.json`: the Chrome trace (chrome://tracing, Perfetto) for the timeline.

The kinds are matched by kernel name (`KINDS`, first match wins): an estimate of where time goes
that names what it counted, not an exact attribution (a fused kernel counts once, in its first kind).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# (kind, kernel or operator name pattern), first match wins: attention before GEMM (cuDNN's attention
# kernels' names carry the architecture, sm90_, as CUTLASS GEMMs' do), copies before elementwise.
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated|dot_product|sparse_mla", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|matmul|\bmm\b|aten::(?:a?mm|bmm|addmm|linear|_scaled_mm|_grouped_mm)|"
                        r"cutlass|xmma|nvjet|sm90_|wgmma|cublas", re.IGNORECASE)),
    ("copy, gather, concat", re.compile(r"copy|memcpy|memset|cat|gather|scatter|index|transpose|contiguous|"
                                        r"clone|to_copy|fill", re.IGNORECASE)),
    ("elementwise and other", re.compile(r".")),
)
TABLE_ROWS = 40


@contextmanager
def profiled(device: torch.device) -> Iterator[profile]:
    """torch.profiler over the block: CPU operators, and CUDA kernels on a GPU."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        yield prof
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(name))


def timed_events(prof: profile, on_device: bool) -> list[tuple[str, Any, float]]:
    """(name, stream, own microseconds) of each kernel (on a device) or CPU operator."""
    events = []
    for event in prof.events():
        # a range a caller marked (record_function: the pipeline schedule's "PP:..." ranges, shown on the
        # device's timeline too) spans kernels counted on their own: counting it would count them twice
        if event.is_user_annotation:
            continue
        if on_device and event.device_type == DeviceType.CUDA:
            events.append((event.name, event.device_resource_id, event.time_range.elapsed_us()))
        elif not on_device and event.device_type == DeviceType.CPU:
            # its own time, its children's excluded: each microsecond counted once, under the
            # operator that spent it (aten::mm, not the autograd node that called it)
            events.append((event.name, "cpu", event.self_cpu_time_total))
    return events


def summarize(prof: profile, on_device: bool, steps: int) -> dict[str, Any]:
    """Seconds per step per stream, and per kind on the busiest stream (module docstring)."""
    per_stream: dict[Any, float] = defaultdict(float)
    per_kind: dict[Any, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, stream, micros in timed_events(prof, on_device):
        per_stream[stream] += micros
        per_kind[stream][kind_of(name)] += micros
    if not per_stream:
        return {"steps": steps, "streams": {}, "compute_stream": None, "kinds": {}}
    busiest = max(per_stream, key=per_stream.get)
    total = per_stream[busiest]
    kinds = {kind: {"seconds_per_step": per_kind[busiest][kind] / 1e6 / steps,
                    "share": per_kind[busiest][kind] / total if total else 0.0}
             for kind, _ in KINDS}
    return {"steps": steps, "what": "CUDA kernel time" if on_device else "CPU operators' own time",
            "streams": {str(s): seconds / 1e6 / steps for s, seconds in per_stream.items()},
            "compute_stream": str(busiest), "kinds": kinds}


def write_profile(prof: profile, out_dir: Path, rank: int, on_device: bool, steps: int) -> dict[str, Any]:
    """The three files of the module docstring into `out_dir`; the summary."""
    sort_by = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS, max_name_column_width=90)
    (out_dir / f"rank{rank}_kernels.txt").write_text(table + "\n", encoding="utf-8")
    summary = summarize(prof, on_device, steps)
    (out_dir / f"rank{rank}_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    prof.export_chrome_trace(str(out_dir / f"rank{rank}_trace.json"))
    return summary
