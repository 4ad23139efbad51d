"""Operations: latency per request, generated tokens per second, peak memory and the serving
metrics of one model.

  * latency of a request: the wall time of the `generate` calls it took part in (every tool
    round; tool execution itself is not model time and is left out). Requests are decoded in
    batches of `decoding.batch_size`, so a request's latency is its batch's: what a server
    batching the same way would show. p50 / p95 interpolate linearly between ranks.
  * generated tokens per second: tokens generated over all requests / the summed wall time of
    all generate calls (prefill included).
  * peak memory: on CUDA `torch.cuda.max_memory_allocated` from just before the model loads to
    the end of its evaluation; on CPU (Linux) the process's peak resident set size over the same
    span (VmHWM, reset through /proc/self/clear_refs), which also counts the interpreter and
    libraries (a few hundred MiB) and memory the allocator kept from the previous model; null
    where neither is available.
  * serving (`serving.py`): MTP speculative-decoding acceptance and the sparse-attention
    indexer's recall, teacher-forced over the chat sets' reference answers.
  * parameters and active parameters (a model in this process): the family's own count of the
    loaded HF directory's architecture (`spec.architecture.parameter_report`, as `glmtune inspect` prints it):
    total without MTP layers, and per token (a MoE's routed experts counted top-k of n; the input
    embedding left out of the headline). An adapter is counted as its base. An endpoint's are not
    known here (null): its engine does not say.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from glmtune.eval.scorers.base import MetricDef
from glmtune.eval.serving import SERVING_METRICS, serving_value

OPERATIONS_METRICS: list[tuple[str, MetricDef]] = [
    ("latency", MetricDef("p50_s", "median latency per request", "seconds", False)),
    ("latency", MetricDef("p95_s", "95th percentile latency per request", "seconds", False)),
    ("throughput", MetricDef("generated_tokens_per_s", "generated tokens per second of generation time",
                             "tokens_per_s", True)),
    ("memory", MetricDef("peak_gib", "peak memory while the model was loaded and evaluated", "gib", False)),
] + [("serving", metric.definition) for metric in SERVING_METRICS]
_GIB = float(1 << 30)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class PeakMemory:
    """Peak memory over a span: `start()` before the model loads, `gib()` at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_ok = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
            self.cpu_ok = _vm_hwm_kib() is not None
        except OSError:
            self.cpu_ok = False

    def gib(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / _GIB
        kib = _vm_hwm_kib() if self.cpu_ok else None
        return kib * 1024 / _GIB if kib is not None else None


def _vm_hwm_kib() -> int | None:
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def summarize(latencies: list[float], generated_tokens: int, generate_s: float, peak_gib: float | None,
              device: torch.device) -> dict:
    """The scorecard's `operations` entry of one model."""
    return {"requests": len(latencies), "latency_s": [round(x, 6) for x in latencies],
            "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "generated_tokens": generated_tokens,
            "generated_tokens_per_s": generated_tokens / generate_s if generate_s > 0 else None,
            "peak_memory_gib": peak_gib, "device": str(device)}


def parameter_counts(spec, weights_dir: Path) -> dict[str, int]:
    """`parameters` and `active_parameters` (per token) of the HF directory `weights_dir` by its
    family's `spec`: the serving-cost facts beside tokens/s and peak memory (distillation's
    teacher against its student)."""
    report = spec.architecture.parameter_report(spec.architecture.args_from_hf(weights_dir))
    return {"parameters": int(report["total_params"]), "active_parameters": int(report["active_params"])}


def operations_values(ops: dict) -> dict[str, float | None]:
    """Metric name -> value, for the `operations/*` metrics."""
    return {"p50_s": ops["p50_s"], "p95_s": ops["p95_s"], "generated_tokens_per_s": ops["generated_tokens_per_s"],
            "peak_gib": ops["peak_memory_gib"],
            **{m.definition.name: serving_value(ops, m.definition.name) for m in SERVING_METRICS}}
