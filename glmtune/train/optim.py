"""AdamW over the trainable parameters, fused where the build supports it.

Weight decay applies to matrices only; norms, biases and 1-D tensors are exempt,
as is common practice for transformer fine-tuning.
"""

from __future__ import annotations

import torch
from torch import nn


def _fused_supported(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                    fused: str | bool = "auto") -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    params = decay + no_decay
    if not params:
        raise ValueError("no trainable parameters: check model freezing / peft target_modules")
    use_fused = _fused_supported(params) if fused == "auto" else bool(fused)
    if use_fused and not _fused_supported(params):
        raise ValueError("optim.fused: true needs all parameters on CUDA")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=use_fused or None)
