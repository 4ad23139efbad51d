"""Rotary position embedding for GLM-5: interleaved pairs over the rope slice only.

GLM-5 rotates the pairs (x[2i], x[2i+1]) of the 64-dim rope slice (GPT-J style)
and writes the result de-interleaved ([rotated evens | rotated odds]); q and k
get the same permutation so dot products equal textbook interleaved RoPE.
cos/sin are computed in fp32 and cast to the activation dtype, as transformers
does, so bf16 runs round them the same way.

Supports `rope_type` "default" and "yarn" (inverse frequencies and the cos/sin
attention factor computed as in transformers' `_compute_yarn_parameters`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope_parameters: dict, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32) and the cos/sin scaling factor."""
    base = float(rope_parameters.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    assert rope_type == "yarn", rope_type
    original_max = rope_parameters.get("original_max_position_embeddings", max_position_embeddings)
    factor = rope_parameters.get("factor") or max_position_embeddings / original_max
    attention_factor = rope_parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def softmax_scale_for(rope_parameters: dict, qk_head_dim: int) -> float:
    """Attention scale 1/sqrt(qk_head_dim), times YaRN's mscale^2 when the config asks for it."""
    scale = qk_head_dim**-0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            mscale = yarn_mscale(rope_parameters["factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [B, S, dim // 2] for given position ids."""

    def __init__(self, rope_parameters: dict, dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rope_parameters = dict(rope_parameters)
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = rope_inv_freq(self.rope_parameters, dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self) -> None:
        # The buffer is not in checkpoints: recompute it after meta-device construction.
        inv_freq, _ = rope_inv_freq(self.rope_parameters, self.dim, self.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids_BS[..., None].float() * self.inv_freq.float()
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dim of `x`; cos/sin broadcast to x[..., ::2]."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1)
