"""Learning-rate schedules: linear warmup, then cosine, linear or constant to a floor."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup_steps: int, max_steps: int, kind: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    decay_steps = max(max_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"optim.scheduler: unknown schedule {kind!r} (cosine, linear, constant)")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, kind: str,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    lr_factor(0, warmup_steps, max_steps, kind, min_lr_ratio)  # validate the kind early
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, max_steps, kind, min_lr_ratio)
    )
