"""The ten checks in order, each timed and caught, with the dependencies between them.

    results = run_checks(Preflight(recipe, overrides, out), console)

A check that raises fails with the exception's message (its traceback goes to
OUT/work/preflight.log); it never stops the others. A check whose premise failed is
skipped, saying which check it waited for, instead of being run on something meaningless:

    5, 6         need complete shards (2), the config, tokenizer and template (3) and something
                 that trains (4); 6 reads the gradients of 5's run even when 5 failed
    7, 8, 9, 10  need the training step (5)

After each check the report is rewritten (`report.write_report`), so an interrupted
preflight leaves what it found.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from rich.console import Console

from glmtune.preflight.context import Preflight
from glmtune.preflight.export import check_export
from glmtune.preflight.generation import check_generation
from glmtune.preflight.loading import check_model
from glmtune.preflight.multiprocess import check_multiprocess
from glmtune.preflight.pins import check_pins
from glmtune.preflight.report import STYLES, write_report
from glmtune.preflight.result import CHECKS, CheckResult, skipped
from glmtune.preflight.resume import check_resume
from glmtune.preflight.runs import ReferenceRun, run_reference
from glmtune.preflight.shards import check_shards
from glmtune.preflight.step import check_gradients, check_step
from glmtune.preflight.trainable import check_trainable


def run_checks(pf: Preflight, console: Console, hash_shards: bool = True) -> list[CheckResult]:
    results: dict[int, CheckResult] = {}
    started = time.time()

    def record(number: int, check: Callable[[], CheckResult]) -> CheckResult:
        console.print(f"[{number}/10] {CHECKS[number][0]}: {CHECKS[number][1]} ...", style="dim", highlight=False)
        start = time.perf_counter()
        try:
            result = check()
        except Exception as exc:  # a failed check, reported; the traceback is kept for a bug report
            with open(pf.work / "preflight.log", "a") as log:
                log.write(f"check {number} ({CHECKS[number][0]}):\n{traceback.format_exc()}\n")
            result = CheckResult(number, "fail", f"{type(exc).__name__}: {exc}",
                                 {"traceback": str(pf.work / "preflight.log")})
        result.seconds = round(time.perf_counter() - start, 2)
        if number >= 5 and pf.has_scratch:  # what the scratch runs trained, in every check that used them
            result.evidence.setdefault("model", pf.describe_model())
        results[number] = result
        style = STYLES[result.status]
        console.print(f"[{number}/10] {result.name}: [{style}]{result.status}[/{style}] ({result.seconds:.1f} s)",
                      highlight=False)
        write_report(pf, [results[n] for n in sorted(results)], started)
        return result

    pf.work.mkdir(parents=True, exist_ok=True)
    record(1, lambda: check_pins(pf))
    record(2, lambda: check_shards(pf, hash_shards))
    record(3, lambda: check_model(pf))
    record(4, lambda: check_trainable(pf))  # on its own config read: it fails itself when that does not load
    blockers = [results[n] for n in (2, 3, 4) if not results[n].ok]
    reference: list[ReferenceRun] = []
    if blockers:
        why = "; ".join(f"check {r.number} ({r.name}) {r.status}" for r in blockers)
        for number in (5, 6):
            record(number, lambda n=number: skipped(n, why))
    else:
        def train_reference() -> CheckResult:
            reference.append(run_reference(pf))
            return check_step(pf, reference[0])

        record(5, train_reference)
        record(6, lambda: check_gradients(pf, reference[0]) if reference else
               skipped(6, "the training step did not run (check 5)"))
    later = {7: lambda: check_resume(pf, reference[0]), 8: lambda: check_export(pf, reference[0]),
             9: lambda: check_generation(pf, reference[0]), 10: lambda: check_multiprocess(pf, reference[0])}
    step = results[5]
    why = f"needs the training step, check 5 {step.status}" + (f" ({step.skip_reason})" if step.skip_reason else "")
    for number, check in later.items():
        record(number, check if step.ok else (lambda n=number: skipped(n, why)))
    return [results[n] for n in sorted(results)]
