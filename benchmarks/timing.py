"""Timing, memory and profiling helpers shared by the benchmarks (one GPU, or the CPU for
smoke tests): warm-up then timed steps with a device sync around them, peak allocator
memory, a per-kernel GPU time table from the torch profiler, and result lines (JSON, printed
and appended to a file)."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def results_path(out: str | None, name: str) -> str | None:
    """--out, else $OUT/NAME when $OUT is set (the device tool's folder), else None."""
    return out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)


def emit(lines: list[dict], out: str | None) -> None:
    """Print each result as a JSON line; append them to `out` too when given."""
    for line in lines:
        print(json.dumps(line), flush=True)
        if out:
            with open(out, "a") as fh:
                fh.write(json.dumps(line) + "\n")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def free_memory():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def loss_step(model, opt, batches: list[dict], loss_of):
    """step(i): batch i on the device, `loss_of(model, batch)` -> (loss sum, its count, ...), the mean's
    backward and an optimizer step; the mean, detached."""

    def step(i):
        batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batches[i].items()}
        loss_sum, count, *_ = loss_of(model, batch)
        loss = loss_sum / count
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def time_training(step_fn, a):
    """`a.warmup` untimed steps, then `a.steps` timed: (seconds per step, every step's loss, peak GiB)."""
    losses = []
    for i in range(a.warmup):
        losses.append(step_fn(i))
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        losses.append(step_fn(i))
    sync()
    seconds = (time.perf_counter() - start) / a.steps
    return seconds, [float(x) for x in losses], peak_gib()


def profile(step, a, stem: str | None = None) -> None:
    """Two profiled steps: $OUT/STEM.txt (op table, then the GPU kernel table) and a Chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for i in range(2):
            step(a.warmup + i)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
    out_dir = os.environ.get("OUT") or "."
    stem = stem or f"profile_seq{a.seq}{'_ckpt' if a.ckpt else ''}"
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=60,
                                                                   max_shapes_column_width=120)
    Path(out_dir, f"{stem}.txt").write_text(table + "\n\n" + kernel_table(prof, steps=2) + "\n\n" + by_shape)
    prof.export_chrome_trace(str(Path(out_dir, f"{stem}.json.gz")))


def kernel_table(prof, steps: int, rows: int = 80) -> str:
    """GPU kernels only, ms per step, largest first: what the device actually spent its time on."""
    per_kernel: dict[str, list[float]] = {}
    for event in prof.events():
        # GPU-side user annotations (e.g. "Optimizer.step#...") span kernels already counted.
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            entry = per_kernel.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1e3 / steps
            entry[1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    lines = [f"GPU kernel time per step: {total:.2f} ms", f"{'ms/step':>9} {'calls':>6}  kernel"]
    for name, (ms, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{ms:9.3f} {calls // steps:6d}  {name[:160]}")
    return "\n".join(lines)
