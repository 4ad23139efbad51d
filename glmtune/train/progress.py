"""What rank 0 shows while it trains: rich's live bar on a terminal, plain lines elsewhere.

A Slurm log, a pipe or a file cannot show a bar that is redrawn in place (rich prints
nothing until it stops), so when stdout is not a terminal each logged step (the
steps written to metrics.jsonl) becomes one line:

    step 12/100  loss 2.3456  grad_norm 0.812  lr 1.00e-05  tok/s 12345  mfu 41.2%  mem 52.1 GiB  eta 0:03:12

`logging.progress: false` shows neither.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any


class StepProgress:
    """Progress of one `Trainer.fit`: a context manager fed every step's metrics record.

    Args:
        enabled: show anything at all (rank 0 and `logging.progress`).
        total: `train.max_steps`.
        completed: the step training starts from (non-zero after a resume).
        log_every: `train.log_every`; plain lines follow the metrics file's steps.
    """

    def __init__(self, enabled: bool, total: int, completed: int, log_every: int = 1) -> None:
        self.enabled, self.total, self.completed, self.log_every = enabled, total, completed, log_every
        self.progress = None
        self.plain = False
        self._start = time.perf_counter()

    def __enter__(self) -> StepProgress:
        if not self.enabled:
            return self
        self._start = time.perf_counter()
        if not sys.stdout.isatty():
            self.plain = True
            return self
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.total, completed=self.completed, loss="-", tps="-")
        return self

    def update(self, record: dict[str, Any]) -> None:
        if self.progress is not None:
            loss = "  ".join([f"{record['loss']:.4f}", *_preference(record)])
            self.progress.update(self.task, completed=record["step"], loss=loss, tps=f"{record['tokens_per_s']:.0f}")
        elif self.plain and self._logged(record):
            # flush: a Slurm log is a file, block-buffered; the line must be there when the step is
            print(self.line(record), flush=True)

    def _logged(self, record: dict[str, Any]) -> bool:
        # The steps `Trainer.fit` writes to the metrics file.
        step = record["step"]
        return step % self.log_every == 0 or step == self.total or "val_loss" in record

    def line(self, record: dict[str, Any]) -> str:
        """One step as text; the ETA extrapolates this process's wall time per step (saves included)."""
        step = record["step"]
        done = step - self.completed
        eta = (time.perf_counter() - self._start) / done * (self.total - step) if done > 0 else 0.0
        parts = [f"step {step}/{self.total}", f"loss {record['loss']:.4f}"]
        if "val_loss" in record and record["val_loss"] is not None:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        parts += _preference(record) + _auxiliary(record)
        parts += [f"grad_norm {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}",
                  f"tok/s {record['tokens_per_s']:.0f}"]
        if record.get("mfu") is not None:
            parts.append(f"mfu {record['mfu']:.1%}")
        if record.get("peak_memory_gib") is not None:
            parts.append(f"mem {record['peak_memory_gib']:.1f} GiB")
        parts.append(f"eta {timedelta(seconds=round(eta))}")
        return "  ".join(parts)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def _preference(record: dict[str, Any]) -> list[str]:
    """A preference objective's margin and accuracy (`dpo/...` in the record), else nothing."""
    if "dpo/margin" not in record:
        return []
    return [f"margin {record['dpo/margin']:.3f}", f"acc {record['dpo/accuracy']:.0%}"]


def _auxiliary(record: dict[str, Any]) -> list[str]:
    """The auxiliary losses' figures when they train (`mtp_loss`, `mtp_acceptance`, `indexer_kl`), else nothing."""
    names = (("mtp_loss", "mtp_loss {:.4f}"), ("mtp_acceptance", "mtp_acc {:.0%}"), ("indexer_kl", "indexer_kl {:.4f}"))
    return [form.format(record[name]) for name, form in names if record.get(name) is not None]

