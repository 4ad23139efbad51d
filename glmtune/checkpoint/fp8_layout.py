"""How HF checkpoints store FP8 block-quantized weights, for any family's loader and writer.

DeepSeek-V3's layout, which GLM-5's and other FP8 releases use: a float8_e4m3fn weight `<key>`
beside an fp32 `<key>_scale_inv` holding one scale per 128 x 128 block of its last two dims
(`glmtune.kernels.fp8_blocks` does the arithmetic). The scale's key suffix is a file-format
convention, not a model's tensor name: the family-agnostic readers (hf_io.py, hf_verify.py,
sharded_load.py, truncated_view.py) pair each scale with its weight by it.
"""

from __future__ import annotations

import torch

from glmtune.kernels import fp8_blocks

FP8_BLOCK = fp8_blocks.BLOCK
SCALE_SUFFIX = "_scale_inv"
is_fp8 = fp8_blocks.is_fp8
check_fp8_scale = fp8_blocks.check_scale


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[i, j] * scale_inv[i // 128, j // 128] in fp32, cast to `dtype`."""
    return fp8_blocks.dequantize(weight, scale_inv, dtype)


def dequantize_fp8_region(weight: torch.Tensor, scale_inv: torch.Tensor, start: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """The rows/cols of an FP8 weight that begin at `start`, dequantized with the scales of
    the blocks that cover them (`scale_inv` starts at block `start // 128`): the same
    values, bit for bit, as those entries of the whole weight's `dequantize_fp8_block`."""
    rows, cols = weight.shape
    row0, col0 = start[0] % FP8_BLOCK, start[1] % FP8_BLOCK
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[row0 : row0 + rows]
    scale = scale.repeat_interleave(FP8_BLOCK, 1)[:, col0 : col0 + cols]
    return (weight.float() * scale).to(dtype)
