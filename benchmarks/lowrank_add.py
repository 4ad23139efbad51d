"""The routed experts' LoRA sum, fused (`glmtune/kernels/lowrank_add.py`) against a grouped
GEMM and an add, at the GLM-5 proxy's shapes (32768 routed rows, 32 experts, rank 32):
milliseconds per call for the shapes the step uses, and the largest difference.

    python benchmarks/lowrank_add.py [--blocks 64x128,128x128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.kernels import lowrank_add  # noqa: E402

SHAPES = {"down output": 6144, "gate_up input gradient": 6144, "gate_up output": 4096, "down input gradient": 2048}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--blocks", default="64x128", help="BLOCK_MxBLOCK_N tile shapes to try")
    a = p.parse_args(argv)
    from triton.testing import do_bench

    gen = torch.Generator("cuda").manual_seed(0)
    counts = torch.multinomial(torch.ones(a.experts, device="cuda"), a.rows, replacement=True, generator=gen)
    counts_E = torch.bincount(counts, minlength=a.experts)
    for what, out_dim in SHAPES.items():
        base = torch.randn(a.rows, out_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        h = torch.randn(a.rows, a.rank, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(a.experts, out_dim, a.rank, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
        ref = lowrank_add.reference(base, h, b, counts_E)
        line = f"{what:24s} [{a.rows}, {out_dim}]  grouped GEMM + add {do_bench(lambda: lowrank_add.reference(base, h, b, counts_E)):.3f} ms"
        for block in a.blocks.split(","):
            lowrank_add.BLOCK_M, lowrank_add.BLOCK_N = (int(v) for v in block.split("x"))
            fused = lowrank_add.lowrank_grouped_add(base, h, b, counts_E, "triton")
            err = (fused.float() - ref.float()).abs().max().item()
            ms = do_bench(lambda: lowrank_add.lowrank_grouped_add(base, h, b, counts_E, "triton"))
            line += f" | fused {block} {ms:.3f} ms (max diff {err:.3g})"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
