"""AdamW over the trainable parameters, fused where the build supports it.

Weight decay applies to matrices only; norms, biases and 1-D tensors are exempt,
as is common practice for transformer fine-tuning.

`optim.fused`: "auto" uses torch's fused AdamW on CUDA; "triton" uses `TritonAdamW`,
the same update from one bandwidth-bound Triton kernel per tensor
(`glmtune/kernels/adamw.py`), whose state dict is torch AdamW's (either can resume
the other's checkpoint). Its loop over the parameters is `MasterAdamW`'s
(`master_adamw.PerTensorAdamW`), without masters and with moments in the parameter's dtype.

With fp32 master weights (`masters=True`, `train.master_weights: fp32` over bf16
parameters) the optimizer is `MasterAdamW` (`master_adamw.py`): "auto" and "triton" update
on CUDA with its Triton kernel ("auto" elsewhere: its torch reference), false runs the
reference anywhere; torch's fused AdamW (true) holds no masters and is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.kernels import adamw
from glmtune.kernels.adamw import adamw_step_
from glmtune.train.master_adamw import MasterAdamW, PerTensorAdamW


def _fused_supported(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                    fused: str | bool = "auto", masters: bool = False) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    params = decay + no_decay
    if not params:
        raise ValueError("no trainable parameters: check model freezing / peft target_modules")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if masters:
        return MasterAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, backend=master_backend(fused, params))
    if fused == "triton":
        if not adamw.available() or not _fused_supported(params):
            raise ValueError("optim.fused: triton needs the triton package and all parameters on CUDA")
        return TritonAdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    use_fused = _fused_supported(params) if fused == "auto" else bool(fused)
    if use_fused and not _fused_supported(params):
        raise ValueError("optim.fused: true needs all parameters on CUDA")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=use_fused or None)


def master_backend(fused: str | bool, params: list[torch.Tensor]) -> str:
    """`optim.fused` read for `MasterAdamW`: its Triton kernel or its torch reference."""
    if fused is True:
        raise ValueError("optim.fused: true is torch's fused AdamW, which holds no fp32 master weights; with "
                         "train.master_weights fp32 use optim.fused: auto or triton (the fused master kernel)")
    gpu_kernel = adamw.available() and _fused_supported(params)
    if fused == "triton" and not gpu_kernel:
        raise ValueError("optim.fused: triton needs the triton package and all parameters on CUDA")
    return "triton" if fused in ("auto", "triton") and gpu_kernel else "torch"


class TritonAdamW(PerTensorAdamW):
    """AdamW (decoupled weight decay) with torch's defaults and state layout, updated by
    one Triton kernel per tensor. No amsgrad, maximize or closure-free differentiable mode."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=None)
        super().__init__(params, defaults)

    def _update(self, param: torch.Tensor, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                step: int, **hyper: float) -> None:
        adamw_step_(p, g, m, v, step=step, **hyper)
