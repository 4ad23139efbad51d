"""Aux-loss-free load balancing (DeepSeek-V3 style) for sigmoid routers.

After each optimizer step, every MoE layer nudges its selection-only correction
bias: experts that received fewer tokens than the mean get +rate, busier ones
-rate. The bias changes which experts are chosen, never the mixing weights, so
the model's function on a fixed routing is untouched. Off by default for SFT:
fine-tuning usually keeps the pretrained balance.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def update_router_biases(moe_modules: list[tuple[str, nn.Module]], tokens_per_expert: dict[str, torch.Tensor],
                         rate: float) -> None:
    for name, module in moe_modules:
        counts = tokens_per_expert[name].float()
        if counts.sum() == 0:
            continue
        bias = module.gate.e_score_correction_bias
        bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)
