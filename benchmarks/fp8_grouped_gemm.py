"""The routed experts' frozen-FP8 products on one GPU: the dequant path (`dequantize_fast` into a
bf16 transient, then the grouped bf16 GEMM) against the W8A16 Triton kernel that dequantizes each
tile in registers (`glmtune/kernels/fp8_grouped_gemm.py`), forward and input gradient, at GLM-5's
expert widths: gate_up (O 4096, I 6144) and down (O 6144, I 2048), 32 local experts, rows routed
at random around a mean per expert.

    python benchmarks/fp8_grouped_gemm.py [--rows 256 512] [--experts 32]

One table: milliseconds (triton.testing.do_bench, median) of each backend, the bf16 grouped GEMM
on an already-dequantized weight (the floor the dequant path pays its transient on top of), the
speedup of triton over dequant, its TFLOP/s, the largest |triton - dequant| against the largest
|dequant| (the two have the same operands and differ by fp32 summation order and one bf16
rounding), and the config the autotuner picked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.kernels import fp8_blocks, fp8_grouped_gemm  # noqa: E402
from glmtune.kernels import fp8_matmul  # noqa: E402
from glmtune.kernels.grouped_gemm import grouped_linear  # noqa: E402

SHAPES = {"gate_up": (4096, 6144), "down": (6144, 2048)}  # (O, I) of one expert


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32, help="local experts (GLM-5 at EP 8: 32)")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512], help="mean rows per expert")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _case(num_experts: int, rows: int, out_dim: int, in_dim: int, gen: torch.Generator) -> dict:
    """An e4m3 weight with its scales, routed rows (uneven counts) and an output gradient, on the GPU."""
    q, scale = fp8_blocks.quantize_weight(torch.randn(num_experts, out_dim, in_dim, device="cuda", generator=gen) * 0.02)
    expert_of_row = torch.randint(0, num_experts, (num_experts * rows,), device="cuda", generator=gen)
    offsets = torch.cumsum(torch.bincount(expert_of_row, minlength=num_experts), 0)
    num_rows = num_experts * rows
    return {"q": q, "scale": scale, "offsets": offsets,
            "x": torch.randn(num_rows, in_dim, device="cuda", dtype=torch.bfloat16, generator=gen),
            "dy": torch.randn(num_rows, out_dim, device="cuda", dtype=torch.bfloat16, generator=gen)}


def _products(c: dict, backend: str) -> tuple:
    """(forward, input gradient) closures through the custom ops `grouped_linear_fp8` calls."""
    forward = lambda: fp8_matmul._grouped_linear_fp8(c["x"], c["q"], c["scale"], c["offsets"], backend)  # noqa: E731
    input_grad = lambda: fp8_matmul._grouped_linear_fp8_input_grad(  # noqa: E731
        c["dy"], c["q"], c["scale"], c["offsets"], backend)
    return forward, input_grad


def _row(name: str, rows: int, c: dict, do_bench) -> dict:
    out_dim, in_dim = c["q"].shape[1:]
    w = fp8_matmul.dequantize_fast(c["q"], c["scale"], torch.bfloat16)
    floors = (lambda: grouped_linear(c["x"], w, c["offsets"], "grouped_mm"),
              lambda: grouped_linear(c["dy"], w.transpose(1, 2), c["offsets"], "grouped_mm"))
    flops = 2 * c["x"].shape[0] * out_dim * in_dim
    row = {"shape": f"{name} {out_dim}x{in_dim}", "rows": rows}
    dequant, triton_ = _products(c, "dequant"), _products(c, "triton")
    for label, ref_fn, ours_fn, floor_fn, w_t in (("fwd", dequant[0], triton_[0], floors[0], False),
                                                 ("dx", dequant[1], triton_[1], floors[1], True)):
        ref, ours = ref_fn(), ours_fn()  # the first triton call autotunes: not timed
        row[f"{label}_config"] = _picked(out_dim if not w_t else in_dim, in_dim if not w_t else out_dim, w_t)
        ms = {key: do_bench(fn) for key, fn in (("dequant", ref_fn), ("triton", ours_fn), ("bf16", floor_fn))}
        row.update({f"{label}_{key}_ms": value for key, value in ms.items()})
        row[f"{label}_speedup"] = ms["dequant"] / ms["triton"]
        row[f"{label}_tflops"] = flops / ms["triton"] / 1e9
        row[f"{label}_maxdiff"] = (ours.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return row


def _picked(out_dim: int, red_dim: int, transposed: bool) -> str:
    """The autotuner's choice for these widths (its cache is keyed by out_dim, red_dim, W_T and dtypes)."""
    tuner = fp8_grouped_gemm._autotuned()
    for key, config in tuner.cache.items():
        if key[:3] == (out_dim, red_dim, transposed):
            kw = config.kwargs
            return (f"{'swap' if kw['SWAP'] else 'plain'} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}"
                    f" w{config.num_warps} s{config.num_stages}")
    return "?"


def _table(rows: list[dict]) -> str:
    head = ("shape", "rows/E", "dir", "dequant ms", "triton ms", "bf16 ms", "speedup", "TFLOP/s", "max|d|/max|ref|",
            "config")
    lines = [head]
    for r in rows:
        for d in ("fwd", "dx"):
            lines.append((r["shape"], str(r["rows"]), d, f"{r[f'{d}_dequant_ms']:.3f}", f"{r[f'{d}_triton_ms']:.3f}",
                          f"{r[f'{d}_bf16_ms']:.3f}", f"{r[f'{d}_speedup']:.2f}x", f"{r[f'{d}_tflops']:.0f}",
                          f"{r[f'{d}_maxdiff']:.2e}", r[f"{d}_config"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_grouped_gemm benchmark: needs a CUDA GPU", file=sys.stderr)
        return 1
    from triton.testing import do_bench

    gen = torch.Generator("cuda").manual_seed(args.seed)
    rows = []
    for name in args.shapes:
        out_dim, in_dim = SHAPES[name]
        for per_expert in args.rows:
            case = _case(args.experts, per_expert, out_dim, in_dim, gen)
            with torch.no_grad():
                rows.append(_row(name, per_expert, case, do_bench))
            del case
            torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, {args.experts} experts, bf16 activations, e4m3 weights (128x128 scales)")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
