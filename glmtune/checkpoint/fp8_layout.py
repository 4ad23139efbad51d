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
# How these releases describe their weights in config.json (a writer of FP8 weights says so).
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[i, j] * scale_inv[i // 128, j // 128] in fp32, cast to `dtype`."""
    return fp8_blocks.dequantize(weight, scale_inv, dtype)


def dequantize_fp8_region(weight: torch.Tensor, scale_inv: torch.Tensor, start: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """The rows/cols of an FP8 weight that begin at `start` (`fp8_blocks.dequantize_region`)."""
    return fp8_blocks.dequantize_region(weight, scale_inv, start, dtype)
