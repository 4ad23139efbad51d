"""A measured training speed, read from where glmtune writes one, as model TFLOP/s per GPU.

A plan's time comes from a measurement, not from a datasheet: a run directory (its
`metrics.jsonl`: the steady windows after the first, which holds compilation), a metrics
file itself, or a benchmark's JSON lines (`benchmarks/throughput.py`: `tflops` and `gpu`).
The speed travels as achieved model TFLOP/s per GPU (the one FLOPs formula, the
model family's `flops_per_token`) so that it transfers to another model size or sequence
length at the same efficiency; tokens/s follow from the target's FLOPs per token. Between
GPU kinds it is scaled by the ratio of their dense bf16 peaks (same MFU), which the plan
states as an assumption.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from glmtune.io.json_file import json_lines
from glmtune.plan.hardware import GPUS, spec_for_device_name

# One logged step or benchmark line is a few hundred bytes.
MAX_RECORD_BYTES = 1 << 20


@dataclass(frozen=True)
class Measurement:
    source: str
    tflops_per_gpu: float
    gpu_peak_tflops: float | None  # the measured GPU's dense bf16 peak, when known
    windows: int  # how many measured windows/lines it averages

    @property
    def mfu(self) -> float | None:
        return self.tflops_per_gpu / self.gpu_peak_tflops if self.gpu_peak_tflops else None


def read_measurement(path: str | Path) -> Measurement:
    """From a run directory, a metrics.jsonl or a benchmark's JSON lines (module docstring)."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--throughput {path}: no metrics.jsonl or JSON-lines file there")
    records = []
    # bounded, named file:line; the last line of a run still writing (or killed) may be cut short
    for number, record, _ in json_lines(file, max_line_bytes=MAX_RECORD_BYTES, kind=None, cut_tail=True):
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{number}: a JSON object per line expected, got {type(record).__name__}")
        records.append(record)
    timed = [r for r in records if _positive(r.get("tflops")) and str(r.get("impl", "glmtune")).startswith("glmtune")]
    if not timed:
        raise ValueError(f"{file}: no glmtune record with a positive `tflops` (every logged step of a "
                         "glmtune run has one; throughput.py writes one per implementation)")
    steady = timed[1:] if "step" in timed[0] and len(timed) > 1 else timed  # a run's first window compiles
    tflops = sum(r["tflops"] for r in steady) / len(steady)
    peak = None
    if _positive(steady[-1].get("mfu")) and steady[-1]["mfu"] <= 1:  # above 1 is no MFU: use the GPU's name
        peak = steady[-1]["tflops"] / steady[-1]["mfu"]
    elif "gpu" in steady[-1]:
        spec = spec_for_device_name(str(steady[-1]["gpu"]))
        peak = spec.bf16_tflops if spec else None
    return Measurement(str(file), tflops, peak, len(steady))


def _positive(value: object) -> bool:
    """A number > 0 and finite (JSON lines may hold NaN and Infinity, which Python's json reads)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def tokens_per_s_per_gpu(measurement: Measurement, flops_per_token: float, target_gpu: str) -> tuple[float, str]:
    """(tokens/s per GPU for the target model, the assumption made to get there)."""
    target_peak = GPUS[target_gpu].bf16_tflops
    tflops, note = measurement.tflops_per_gpu, f"{measurement.tflops_per_gpu:.0f} TFLOP/s per GPU measured"
    if measurement.gpu_peak_tflops and abs(measurement.gpu_peak_tflops - target_peak) > 1:
        tflops *= target_peak / measurement.gpu_peak_tflops
        note += f", scaled to {target_gpu} at the same MFU ({measurement.mfu:.1%})"
    return tflops * 1e12 / flops_per_token, note
