"""One line per rank report of `glmtune plan --measure --json` in a folder (what
`benchmarks/rank_variants.sh` writes): compute, the emulated step and its exposed communication,
the links' floor (every transfer hidden) and what bounds it,
each link lane's busy seconds, tokens/s per GPU, the measured peak beside the planned one, and the
timed step's losses, so that variants run in one device call read side by side.

    python benchmarks/rank_reports.py OUT [OUT ...]

A report that is not JSON (a run cut short by its timeout) is named as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def report_line(name: str, report: dict) -> str:
    """The figures of one report (module docstring)."""
    emulated, timing, memory = report.get("emulated") or {}, report["time"], report["memory"]
    lanes = {axes: round(sum(ops.values()), 3) for axes, ops in (emulated.get("lane_seconds") or {}).items()}
    parts = [name, f"compute {timing['step_s']:.3f} s"]
    if emulated:
        parts += [f"emulated {emulated['measured_step_s']:.3f} s", f"with bubble {emulated['step_s']:.3f} s",
                  f"exposed {emulated['exposed_comm_s']:.3f} s"]
        if "floor_s" in emulated:  # reports before the floor was added have none
            parts.append(f"floor {emulated['floor_s']:.3f} s ({emulated['floor_bound']})")
    parts.append(f"tokens/s per GPU {report['tokens_per_s_per_gpu']:.1f}")
    if memory.get("peak_bytes"):
        parts.append(f"peak {memory['peak_bytes'] / GIB:.2f} of {memory['planned_peak_bytes'] / GIB:.2f} GiB planned")
    parts += [f"lanes {json.dumps(lanes)}", f"losses {timing.get('losses')}"]
    return " | ".join(parts)


def main(folders: list[str]) -> int:
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                report = json.loads(path.read_text())
            except json.JSONDecodeError:
                print(f"{path.name} | not a report (the run was cut short?)")
                continue
            print(report_line(path.name, report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
