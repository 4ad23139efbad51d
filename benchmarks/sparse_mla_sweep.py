"""Tile configs of the fused sparse-MLA kernels (`glmtune.kernels.sparse_mla`) on the GPU, at GLM-5's widths.

    OUT=… python benchmarks/sparse_mla_sweep.py --seq 4096

The queries of a cp-8 head_tail rank of an 8 x seq row (rank 0: the row's first and last
chunks) over their causal past, each with min(top-2048, its past) random keys, 64 heads,
latent 512 + rope 64, bf16. Per config of one kernel (the others at their defaults): the
forward's ms, or the whole backward's ms and its two kernels' share (torch.profiler's CUDA
time per kernel: the dQ kernel and the atomics of the key-gradient kernel). Model TFLOP/s:
2 x heads x selected keys x (576 + 512) for the forward, 2.5 x that for the backward
(dS^T q, P^T dO, dQ, with S and dP recomputed). One JSON line per kernel, appended to
$OUT/sparse_mla_sweep.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dsa_kernels import bench_ms, layer_case, topk_selection  # noqa: E402
from benchmarks.timing import emit, results_path  # noqa: E402
from glmtune.kernels import sparse_mla as kernels  # noqa: E402
from glmtune.models.glm5.absorbed_attention import selected_keys  # noqa: E402

SWEEP = {
    "FORWARD_CONFIG": [dict(BLOCK_H=h, BLOCK_N=n, num_warps=w, num_stages=s)
                       for h, n, w, s in itertools.product((16, 32, 64), (32, 64), (4, 8), (2,))],
    "DQ_CONFIG": [dict(BLOCK_H=h, BLOCK_N=n, num_warps=w, num_stages=s)
                  for h, n, w, s in itertools.product((16, 32, 64), (32, 64), (4, 8), (2,))]
    + [dict(BLOCK_H=64, BLOCK_N=n, num_warps=16, num_stages=2) for n in (32, 64)],
    "DKV_CONFIG": [dict(BLOCK_N=n, BLOCK_C=c, num_warps=w, num_stages=1)
                   for n, c, w in itertools.product((32, 64, 128), (64, 128), (4, 8))],
}


def rank_inputs(seq: int, topk: int = 2048, heads: int = 64, latent: int = 512, rope: int = 64):
    """q [S, N, C], c [T, C], index / valid [S, K] of cp-8 rank 0's queries of an 8 x seq row."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    positions, keys, _ = layer_case("cp8_rank0", seq, "cuda")
    index, valid = selected_keys(topk_selection(positions, keys, topk, gen), topk)
    q = torch.randn(seq, heads, latent + rope, generator=gen, device="cuda").bfloat16()
    c = torch.randn(keys, latent + rope, generator=gen, device="cuda").bfloat16()
    return q, c, index[0], valid[0], seq, keys, (192 + rope) ** -0.5, latent


def _kernel_ms(fn) -> dict:
    """CUDA ms per kernel name of one call of `fn` (after a warm call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / 1e3, 3) for e in prof.key_averages() if e.device_time_total > 0}


def sweep(seq: int, only: list[str]) -> list[dict]:
    q, c, index, valid, queries, keys, scale, latent = rank_inputs(seq)
    # The kernels' operands as the layer hands them over: q's parts apart, c's as views of one tensor.
    parts = (q[..., :latent].contiguous(), q[..., latent:].contiguous(), c[None, :, :latent], c[None, :, latent:])
    out, lse = kernels.sparse_mla_forward(*parts, index, valid, queries, scale)
    grad = torch.randn_like(out)
    flops = 2 * q.shape[1] * int(valid.sum()) * (q.shape[-1] + latent)
    forward = lambda: kernels.sparse_mla_forward(*parts, index, valid, queries, scale)  # noqa: E731
    backward = lambda: kernels.sparse_mla_backward(grad, *parts, index, valid, out, lse, queries, scale)  # noqa: E731
    lines = []
    for name, configs in SWEEP.items():
        if name not in only:
            continue
        default = dict(getattr(kernels, name))
        line = {"check": "sparse_mla_sweep", "kernel": name, "queries": queries, "keys": keys,
                "selected": int(valid.sum()), "default": default, "timings": {}}
        for config in configs:
            getattr(kernels, name).update(config)
            label = "_".join(f"{k}{v}" for k, v in config.items())
            fn = forward if name == "FORWARD_CONFIG" else backward
            try:
                ms = bench_ms(fn, 2, 5)
                line["timings"][label] = {"ms": round(ms, 3), "model_tflops": round(
                    flops * (1 if fn is forward else 2.5) / ms / 1e9, 1)}
            except Exception as exc:  # a tile this GPU cannot hold: report it, try the next
                line["timings"][label] = f"{type(exc).__name__}: {str(exc)[:120]}"
        getattr(kernels, name).update(default)
        lines.append(line)
    sparse = torch.zeros(1, queries, keys, dtype=torch.bool, device="cuda")
    sparse[0].scatter_(-1, index, valid)
    lines.append({"check": "sparse_mla_kernels", "queries": queries, "forward_kernels_ms": _kernel_ms(forward),
                  "backward_kernels_ms": _kernel_ms(backward),
                  "selected_keys_ms": round(bench_ms(lambda: selected_keys(sparse, index.shape[-1]), 2, 5), 3)})
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--only", nargs="*", default=list(SWEEP), choices=list(SWEEP),
                   help="the kernels whose configs to sweep (none: only the defaults' per-kernel times)")
    a = p.parse_args(argv)
    for seq in a.seq:
        lines = sweep(seq, a.only)
        for line in lines:
            line["gpu"] = torch.cuda.get_device_name()
        emit(lines, results_path(None, "sparse_mla_sweep.jsonl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
