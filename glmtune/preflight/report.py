"""The preflight report: OUT/preflight.json (everything), OUT/preflight.md (to read), a console table.

preflight.json holds the run (recipe, overrides, scratch configuration and how it differs
from the recipe, seconds, verdict, exit status) and every check's number, name, status,
message, skip reason, seconds and evidence. preflight.md shows the same: a table of the ten
checks, then one section per check with its message and evidence; the gradient norms per
path (check 6) and the base and trained outputs (check 9) as tables. Both files are
replaced whole (written beside, then renamed), after every check.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CHECKS, CheckResult, json_safe

STYLES = {"pass": "green", "fail": "red", "skip": "yellow"}
REPORT_FORMAT = 1


def exit_status(results: list[CheckResult]) -> int:
    """0 when all ten checks pass; 1 when any failed or was skipped (a skip proves nothing)."""
    return 0 if len(results) == len(CHECKS) and all(r.ok for r in results) else 1


def report_dict(pf: Preflight, results: list[CheckResult], started: float) -> dict[str, Any]:
    status = exit_status(results)
    return json_safe({
        "format": REPORT_FORMAT, "recipe": str(pf.recipe), "overrides": pf.overrides, "out": str(pf.out),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 2), "passed": status == 0, "exit_status": status,
        "scratch": {"config": str(pf.scratch_yaml), "model": pf.describe_model() if pf.has_scratch else None,
                    "differs_from_the_recipe": pf.notes},
        "counts": {s: sum(r.status == s for r in results) for s in STYLES},
        "checks": [r.to_dict() for r in results],
    })


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _section_tables(result: CheckResult) -> list[str]:
    """The tables a check's evidence reads best as."""
    e = result.evidence
    if result.number == 6 and "paths" in e:
        steps = [k for k in next(iter(e["paths"].values())) if k.startswith("norm_step_")]
        lines = ["| path | trainable | " + " | ".join(s.replace("norm_", "norm at ") for s in steps) + " | state |",
                 "|---|---:|" + "---:|" * len(steps) + "---|"]
        for group, row in e["paths"].items():
            norms = " | ".join(f"{row[s]:.4g}" if isinstance(row[s], float) else _cell(row[s]) for s in steps)
            lines.append(f"| {group} | {row['trainable']:,} | {norms} | {_cell(row['state'])} |")
        return lines + [""]
    if result.number == 9 and "samples" in e:
        lines = ["| prompt | reference | base | trained |", "|---|---|---|---|"]
        lines += [f"| {_cell(s['prompt'][:120])} | {_cell(s['reference'])} | {_cell(s['base'])} | "
                  f"{_cell(s['trained'])} |" for s in e["samples"]]
        return lines + [""]
    return []


def report_markdown(report: dict[str, Any], results: list[CheckResult]) -> str:
    verdict = "PASS: all ten checks pass" if report["passed"] else \
        f"FAIL: {report['counts']['fail']} failed, {report['counts']['skip']} skipped (exit status 1)"
    lines = [f"# glmtune preflight: {report['recipe']}", "",
             f"**{verdict}** — {report['started']}, {report['seconds']:.0f} s; overrides: "
             f"`{' '.join(report['overrides']) or 'none'}`", ""]
    if report["scratch"]["model"]:
        lines += [f"Checks 5-10 ran on {report['scratch']['model']}, scratch configuration "
                  f"`{report['scratch']['config']}`; it differs from the recipe in:", ""]
        lines += [f"- {note}" for note in report["scratch"]["differs_from_the_recipe"]] + [""]
    else:
        lines += ["Checks 5-10 did not start (see their skip reasons).", ""]
    lines += ["| # | check | status | s | evidence |", "|---:|---|---|---:|---|"]
    lines += [f"| {r.number} | {r.title} | {r.status.upper()} | {r.seconds:.1f} | {_cell(r.message)} |"
              for r in results]
    lines += ["", "A check passes only on the evidence below; a skipped check was not run (its reason says "
                  "which check it depends on) and counts as not passed.", ""]
    for result, data in zip(results, report["checks"]):
        lines += [f"## {result.number}. {result.title}: {result.status.upper()}", "", _cell(result.message), ""]
        lines += _section_tables(result)
        if data["evidence"]:
            lines += ["<details><summary>evidence</summary>", "", "```json",
                      json.dumps(data["evidence"], indent=2, ensure_ascii=False), "```", "", "</details>", ""]
    return "\n".join(lines)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(pf: Preflight, results: list[CheckResult], started: float) -> dict[str, Any]:
    report = report_dict(pf, results, started)
    _replace(pf.out / "preflight.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    _replace(pf.out / "preflight.md", report_markdown(report, results) + "\n")
    return report


def results_table(results: list[CheckResult]) -> Table:
    table = Table(title="glmtune preflight", title_justify="left", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("check")
    table.add_column("status")
    table.add_column("s", justify="right")
    table.add_column("evidence", overflow="fold")
    for r in results:
        table.add_row(str(r.number), r.name, f"[{STYLES[r.status]}]{r.status}[/{STYLES[r.status]}]",
                      f"{r.seconds:.1f}", r.message)
    return table
