"""The frozen-FP8 products on the GPU against the dequantized bf16 reference, at GLM-5 widths:
forward and input gradient, relative error and milliseconds, for each dense backend and the
routed experts (32 local experts, 32768 routed rows: one GPU's share at EP 8).

    python benchmarks/fp8_products.py

Reference: the same e4m3 weights dequantized once to bf16, plain bf16 GEMMs (what a bf16
checkpoint of those weights computes). Errors are ||ours - reference|| / ||reference||.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.kernels import fp8_blocks  # noqa: E402
from glmtune.kernels.fp8_matmul import grouped_linear_fp8, linear_fp8  # noqa: E402
from glmtune.kernels.grouped_gemm import grouped_linear  # noqa: E402

DENSE = {"q_a_proj": (2048, 6144), "q_b_proj": (16384, 2048), "kv_b_proj": (28672, 512), "o_proj": (6144, 16384),
         "shared gate_proj": (2048, 6144), "shared down_proj": (6144, 2048)}
EXPERTS = {"experts gate_up": (4096, 6144), "experts down": (6144, 2048)}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(fn, x, grad):
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def main() -> int:
    from triton.testing import do_bench

    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name, (out_dim, in_dim) in DENSE.items():
        q, scale = fp8_blocks.quantize_weight(torch.randn(out_dim, in_dim, device="cuda", generator=gen) * 0.02)
        w = fp8_blocks.dequantize(q, scale, torch.bfloat16)
        x = torch.randn(4096, in_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        grad = torch.randn(4096, out_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = _run(lambda t: t @ w.t(), x, grad)
        row = {"product": name, "shape": [4096, in_dim, out_dim],
               "bf16_ms": round(do_bench(lambda: _run(lambda t: t @ w.t(), x, grad)), 3)}
        for backend in ("dequant", "scaled_mm"):
            ours = _run(lambda t: linear_fp8(t, q, scale, backend), x, grad)
            row[backend] = {"forward_rel": _rel(ours[0], ref[0]), "input_grad_rel": _rel(ours[1], ref[1]),
                            "ms": round(do_bench(lambda: _run(lambda t: linear_fp8(t, q, scale, backend), x, grad)), 3)}
        rows.append(row)
    counts = torch.bincount(torch.randint(0, 32, (32768,), device="cuda", generator=gen), minlength=32)
    offsets = torch.cumsum(counts, 0)
    for name, (out_dim, in_dim) in EXPERTS.items():
        q, scale = fp8_blocks.quantize_weight(torch.randn(32, out_dim, in_dim, device="cuda", generator=gen) * 0.02)
        w = fp8_blocks.dequantize(q, scale, torch.bfloat16)
        x = torch.randn(32768, in_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        grad = torch.randn(32768, out_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = _run(lambda t: grouped_linear(t, w, offsets, "grouped_mm"), x, grad)
        ours = _run(lambda t: grouped_linear_fp8(t, q, scale, offsets), x, grad)
        rows.append({"product": name, "shape": [32768, in_dim, out_dim, 32],
                     "bf16_ms": round(do_bench(lambda: _run(lambda t: grouped_linear(t, w, offsets, "grouped_mm"), x, grad)), 3),
                     "dequant": {"forward_rel": _rel(ours[0], ref[0]), "input_grad_rel": _rel(ours[1], ref[1]),
                                 "ms": round(do_bench(lambda: _run(lambda t: grouped_linear_fp8(t, q, scale, offsets), x, grad)), 3)}})
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
