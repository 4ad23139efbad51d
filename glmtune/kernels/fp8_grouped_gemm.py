"""Grouped GEMM over rows grouped by expert with a blockwise-FP8 weight read as it is (W8A16).

    forward:     y[n]  = x[n]  @ W[e(n)]^T     x [N, I], W e4m3 [E, O, I] -> y [N, O]
    input grad:  dx[n] = dy[n] @ W[e(n)]       dy [N, O]                   -> dx [N, I]

with the 128 x 128 block scales of `fp8_blocks` (scale [E, O/128, I/128]) and `offsets_E` the
cumulative row ends (expert e owns rows offsets[e-1]:offsets[e]; an expert may own none). The
dequant path (`fp8_matmul.dequantize_fast` + the grouped bf16 GEMM) writes a bf16 copy of the
whole stacked weight and the GEMM reads it back; here each program loads a [BLOCK_N, BLOCK_K]
tile of e4m3 (1 byte an element), converts it to fp32, multiplies it by its block's scale and
rounds it to the activations' dtype in registers, then `tl.dot` with fp32 accumulation. That is
`dequantize_fast`'s arithmetic element for element, so every product has the dequant path's
operands and the two differ only in the order of the fp32 sums.

Both directions are one kernel: the output's column j and the reduction index k address the
weight as W[e, j, k] (forward) or W[e, k, j] (input gradient, `W_T`: the weight read transposed
in place, no transposed copy). A group of one expert (offsets [N]) is a dense linear.

Grid: axis 0 the output's column tiles, axis 1 the row tiles of every expert, sized for the
worst case (ceil(N / BLOCK_M) + E: each expert's last tile may be partial) so that the launch
needs no host sync on the offsets. Each program finds its expert from the offsets (a cumulative
sum of the experts' tile counts in registers, as `lowrank_add.py` does); programs past the last
tile return at once, and a row tile never straddles two experts. Column tiles vary fastest: the
programs resident at one time are a few row tiles (one or two experts) times all column tiles,
so a row tile of x and an expert's weight are read from DRAM about once and from L2 by the
others. A persistent loop would save the idle programs (at most E x the column tiles, each a
few loads) at the price of a tile scheduler in the kernel: not worth it here.

Tiles: BLOCK_N and BLOCK_K divide 128, so a weight tile lies in one scale block: one scalar
scale per K step. Two operand orders (`SWAP`, a config the autotuner chooses between): x W^T as
written, or (W x^T)^T. Compiled for sm_90, the first stores the dequantized tile to shared
memory every K step (wgmma's right operand must be there) and waits for the product before the
next store; swapped, the tile is wgmma's left operand straight from registers and the product
overlaps the next tile's dequantization, at the price of a register shuffle through shared
memory. Which is faster on an H100 is for `benchmarks/fp8_grouped_gemm.py` to say.

Shapes: O and I must be multiples of 128 (GLM-5's 6144, 2048, 4096 are); `usable` says whether
a call can take this kernel, and `fp8_matmul.grouped_linear_fp8` falls back to the dequant path
where it cannot (the tiny test model's widths). fp32 activations multiply in IEEE fp32 (not
TF32), as the dequant path's fp32 GEMM does.

Tested in Triton's CPU interpreter against the dequant path and a float64 sum, and compiled for
sm_90 with every config (tests/kernels/test_fp8_grouped_gemm.py).

Legend: N rows, I input width, O output width, E experts; in the kernel J the output's width
(O forward, I input grad) and K the reduction's (I forward, O input grad).
"""

from __future__ import annotations

import functools

import torch

from glmtune.kernels import fp8_blocks
from glmtune.kernels.moe_combine import _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Launch configs autotuned on the GPU, keyed by the widths and the direction: few, since each one
# is compiled (and timed) at the first call of every key. Shared memory per stage: BLOCK_M x BLOCK_K
# x 2 bytes of x plus BLOCK_N x BLOCK_K of e4m3 (116-160 KiB with these stages, compiled for sm_90).
# SWAP is a config, not a constant: which order is faster on an H100 has not been measured yet
# (benchmarks/fp8_grouped_gemm.py prints the one the autotuner picks).
CONFIGS = [
    {"SWAP": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"SWAP": True, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"SWAP": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
]
# Triton's CPU interpreter (TRITON_INTERPRET=1) runs this one, untuned; the tests change it.
INTERPRETER_CONFIG = {"SWAP": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
_LAUNCH_KEYS = ("num_warps", "num_stages")


def _fp8_grouped_gemm_kernel(a_ptr, w_ptr, scale_ptr, offsets_ptr, out_ptr, out_dim, red_dim, num_experts,
                             W_T: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows, cols] of one row tile of one expert: a [N, K] @ (W[e] dequantized) [K, J]."""
    # This row tile's expert: each expert's ceil(rows / BLOCK_M) tiles are numbered in turn.
    # (Inline, not a helper: Triton's interpreter spends longer on a call than on this.)
    tile = tl.program_id(1)
    experts = tl.arange(0, E_POW2)
    exists = experts < num_experts
    ends = tl.load(offsets_ptr + experts, mask=exists, other=0).to(tl.int32)
    begins = tl.load(offsets_ptr + experts - 1, mask=exists & (experts > 0), other=0).to(tl.int32)
    tiles = (ends - begins + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= tile).to(tl.int32), 0)
    if expert >= num_experts:
        return  # the grid covers the worst case; this tile is past the last one
    mine = experts == expert
    first_row = tl.sum(tl.where(mine, begins + (tile - tile_end + tiles) * BLOCK_M, 0), 0)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    row_ok = (rows < row_end)[:, None]
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # J is a multiple of BLOCK_N: no mask
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * red_dim + ks[None, :]
    w_expert = w_ptr + expert.to(tl.int64) * out_dim * red_dim
    scale_expert = scale_ptr + expert * (out_dim // 128) * (red_dim // 128)
    col_block = tl.program_id(0) * BLOCK_N // 128
    if W_T:  # W[e, k, j]: the input gradient's [J, K] tile is W's rows read as columns
        w_ptrs = w_expert + cols[:, None] + ks[None, :] * out_dim
        w_step = BLOCK_K * out_dim
        scale_ptrs, scale_step = scale_expert + col_block, out_dim // 128
    else:  # W[e, j, k]: the forward's [J, K] tile is rows of W
        w_ptrs = w_expert + cols[:, None] * red_dim + ks[None, :]
        w_step = BLOCK_K
        scale_ptrs, scale_step = scale_expert + col_block * (red_dim // 128), 1
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, red_dim, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok, other=0.0)
        scale = tl.load(scale_ptrs + (k // 128) * scale_step)
        # dequantize_fast's arithmetic: e4m3 -> fp32, times the block's scale, one rounding to x's dtype
        w = (tl.load(w_ptrs).to(tl.float32) * scale).to(a.dtype)
        # SWAP computes out^T = W a^T: on Hopper the dequantized tile, in registers, is then wgmma's
        # left operand as it is (the right one must be in shared memory; see the module docstring).
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += w_step
    if SWAP:
        acc = tl.trans(acc)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_dim + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@functools.cache
def _jit():
    return triton.jit(_fp8_grouped_gemm_kernel)  # lazily: the CPU interpreter (TRITON_INTERPRET=1) may be switched on first


@functools.cache
def _autotuned():
    configs = [triton.Config({k: v for k, v in c.items() if k not in _LAUNCH_KEYS}, num_warps=c["num_warps"],
                             num_stages=c["num_stages"]) for c in CONFIGS]
    return triton.autotune(configs, key=["out_dim", "red_dim", "W_T"])(_jit())


def runs_on(device: torch.device) -> bool:
    """Triton is installed and `device` is CUDA (or the CPU under Triton's interpreter)."""
    return triton is not None and (device.type == "cuda" or device.type == "cpu" and _interpreting())


def usable(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether this kernel can compute a product of x with the weight w_q [E, O, I]: it runs on x's
    device, w_q is e4m3, and O and I are multiples of 128 (a tile then lies in one scale block)."""
    block = fp8_blocks.BLOCK
    return (runs_on(x.device) and w_q.dtype == fp8_blocks.E4M3 and w_q.shape[-1] % block == 0
            and w_q.shape[-2] % block == 0)


def _launch(a_NK: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, offsets_E: torch.Tensor,
            out_dim: int, transposed: bool) -> torch.Tensor:
    rows, red_dim = a_NK.shape
    num_experts = w_q.shape[0]
    fp8_blocks.check_scale(tuple(w_q.shape), tuple(w_scale.shape))
    assert usable(a_NK, w_q) and offsets_E.numel() == num_experts, "fp8 grouped gemm: see `usable`"
    out = a_NK.new_empty(rows, out_dim)
    if rows == 0:
        return out
    args = (a_NK.contiguous(), w_q.contiguous(), w_scale.float().contiguous(), offsets_E.contiguous(), out,
            out_dim, red_dim, num_experts)
    meta = {"W_T": transposed, "PRECISION": "ieee" if a_NK.dtype == torch.float32 else "tf32",
            "E_POW2": triton.next_power_of_2(num_experts)}
    if _interpreting():
        c = INTERPRETER_CONFIG
        _jit()[(out_dim // c["BLOCK_N"], triton.cdiv(rows, c["BLOCK_M"]) + num_experts)](*args, **meta, **c)
    else:
        grid = lambda c: (out_dim // c["BLOCK_N"], triton.cdiv(rows, c["BLOCK_M"]) + num_experts)  # noqa: E731
        _autotuned()[grid](*args, **meta)
    return out


def fp8_grouped_linear(x_NI: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       offsets_E: torch.Tensor) -> torch.Tensor:
    """y[n] = x[n] @ W[e(n)]^T: x [N, I], e4m3 W [E, O, I] with 128 x 128 scales -> y [N, O] in x's dtype."""
    return _launch(x_NI, w_q, w_scale, offsets_E, w_q.shape[1], transposed=False)


def fp8_grouped_input_grad(grad_NO: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                           offsets_E: torch.Tensor) -> torch.Tensor:
    """dx[n] = dy[n] @ W[e(n)]: dy [N, O], e4m3 W [E, O, I] -> dx [N, I] in dy's dtype."""
    return _launch(grad_NO, w_q, w_scale, offsets_E, w_q.shape[2], transposed=True)
