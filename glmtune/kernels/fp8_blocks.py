"""The blockwise FP8 format of GLM-5's (and DeepSeek-V3's) FP8 checkpoints, in torch.

Weights are float8_e4m3fn with one fp32 `scale_inv` per 128 x 128 block of the last two
dims (w = q * scale_inv; the last block of a dim may be partial); stacked expert weights
[E, R, C] carry scales [E, ceil(R/128), ceil(C/128)]. Activations (and output gradients)
for blockwise-scaled GEMMs are quantized per 1 x 128 block along the reduction dim. A
block's scale is its absolute maximum over 448 (e4m3's largest finite value), so every
quantized value is finite and the block's largest entry round-trips exactly.

Pure torch: runs on CPU and is the reference of the GPU's one-pass dequantization
(`fp8_matmul.dequantize_fast`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_TINY = 1e-12  # an all-zero block gets this scale, not 0 (no 0/0)


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `weight_shape`: one scale per 128 x 128 block."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // BLOCK), -(-cols // BLOCK))


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., R, C] zero-padded to multiples of 128 and viewed as [..., R/128, 128, C/128, 128]."""
    *lead, rows, cols = x.shape
    pad_r, pad_c = -rows % BLOCK, -cols % BLOCK
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.view(*lead, (rows + pad_r) // BLOCK, BLOCK, (cols + pad_c) // BLOCK, BLOCK)


def check_scale(weight_shape: tuple[int, ...], scale_inv_shape: tuple[int, ...]) -> None:
    """ValueError naming both shapes unless the scales cover the weight in 128 x 128 blocks."""
    expected = scale_shape(tuple(weight_shape))
    if tuple(scale_inv_shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv_shape)} does not match weight "
                         f"{tuple(weight_shape)} in {BLOCK}x{BLOCK} blocks (expected {expected})")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale_inv per 128 x 128 block, computed in fp32, in `dtype`; [..., R, C] like `weight`."""
    check_scale(tuple(weight.shape), tuple(scale_inv.shape))
    *lead, rows, cols = weight.shape
    blocks = _padded_blocks(weight.float()) * scale_inv.float()[..., :, None, :, None]
    return blocks.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].to(dtype)


def _quantized_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the weight's fp32 blocks [..., R/128, 128, C/128, 128] zero-padded, their scale_inv [..., R/128,
    C/128], the e4m3 blocks): each block's absmax / 448 (module docstring)."""
    blocks = _padded_blocks(weight.float())
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(_TINY) / E4M3_MAX
    return blocks, scale, (blocks / scale[..., :, None, :, None]).to(E4M3)


def _unpadded(q_blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Blocks back to the weight's [..., R, C] layout, the padding dropped."""
    rows, cols = shape[-2:]
    return q_blocks.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) per 128 x 128 block of the last two dims."""
    _, scale, q = _quantized_blocks(weight)
    return _unpadded(q, weight.shape), scale


def quantize_weight_with_error(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
    """`quantize_weight`, and (squared error of its dequantized value, squared norm) of the weight: what
    re-quantizing a merged model reports. The error is taken in fp32 from the blocks quantized (q *
    scale_inv - w, the fp32 product `dequantize` rounds once), its square summed by `vector_norm`: a
    statistic of a few significant digits, computed without fp64 copies of the weight (3x faster)."""
    blocks, scale, q = _quantized_blocks(weight)  # zero padding: quantized to 0, no error
    error = torch.addcmul(blocks, q.float(), scale[..., :, None, :, None], value=-1.0)
    squares = (torch.linalg.vector_norm(error).item() ** 2, torch.linalg.vector_norm(blocks).item() ** 2)
    return _unpadded(q, weight.shape), scale, squares


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, fp32 scale [M, ceil(K/128)]) per 1 x 128 block of each row of x [M, K]."""
    rows, cols = x.shape
    pad = -cols % BLOCK
    blocks = F.pad(x.float(), (0, pad)).view(rows, -1, BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp_min(_TINY) / E4M3_MAX
    q = (blocks / scale[..., None]).to(E4M3)
    return q.view(rows, -1)[:, :cols], scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_rows` (up to e4m3 rounding)."""
    rows, cols = q.shape
    pad = -cols % BLOCK
    blocks = F.pad(q.float(), (0, pad)).view(rows, -1, BLOCK) * scale[..., None]
    return blocks.view(rows, -1)[:, :cols].to(dtype)


def dequantize_region(weight: torch.Tensor, scale_inv: torch.Tensor, start: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """The rows/cols of an FP8 weight that begin at `start`, dequantized with the scales of
    the blocks that cover them (`scale_inv` starts at block `start // BLOCK`): the same
    values, bit for bit, as those entries of the whole weight's `dequantize`."""
    rows, cols = weight.shape
    row0, col0 = start[0] % BLOCK, start[1] % BLOCK
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[row0 : row0 + rows]
    scale = scale.repeat_interleave(BLOCK, 1)[:, col0 : col0 + cols]
    return (weight.float() * scale).to(dtype)
