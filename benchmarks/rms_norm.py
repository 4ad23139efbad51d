"""RMSNorm on the GPU: the eager norm against `model.norm_backend: triton` (`glmtune/kernels/rms_norm.py`)
at GLM-5's widths, forward and forward + backward in milliseconds per call, and how far the kernels'
bf16 results are from eager's (the CPU interpreter cannot check bf16: it truncates).

    python benchmarks/rms_norm.py [--rows 4096] [--widths 6144,2048,512]

One JSON line per width (also appended to $OUT/rms_norm.jsonl): milliseconds for each backend, and
for out, dx and dweight the share of elements equal to eager's and the largest distance in bf16 steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import emit, results_path  # noqa: E402
from glmtune.models.common.rmsnorm import RMSNorm  # noqa: E402


def _norm(width: int, weight: torch.Tensor, backend: str) -> RMSNorm:
    norm = RMSNorm(width).to(device="cuda", dtype=torch.bfloat16)
    norm.weight.data.copy_(weight)
    norm.backend = backend
    return norm


def _run(norm: RMSNorm, x: torch.Tensor, dout: torch.Tensor):
    norm.weight.grad = None
    xi = x.detach().requires_grad_()
    out = norm(xi)
    out.backward(dout)
    return out.detach(), xi.grad, norm.weight.grad


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()
    return {"equal": round((a == b).float().mean().item(), 6), "max_steps": steps}


def measure(rows: int, width: int) -> dict:
    from triton.testing import do_bench

    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    weight = (torch.rand(width, device="cuda", generator=gen) + 0.5).bfloat16()
    dout = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    line = {"rows": rows, "width": width, "gpu": torch.cuda.get_device_name()}
    results = {}
    for backend in ("torch", "triton"):
        norm = _norm(width, weight, backend)
        results[backend] = _run(norm, x, dout)
        with torch.no_grad():
            line[f"{backend}_forward_ms"] = round(do_bench(lambda: norm(x)), 4)
        line[f"{backend}_forward_backward_ms"] = round(do_bench(lambda: _run(norm, x, dout)), 4)
    for name, eager, fused in zip(("out", "dx", "dweight"), results["torch"], results["triton"]):
        line[name] = _agreement(fused, eager)
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--widths", default="6144,2048,512")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rms_norm.py times the kernels on a CUDA GPU; none is visible here")
    emit([measure(a.rows, int(w)) for w in a.widths.split(",")], results_path(a.out, "rms_norm.jsonl"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
