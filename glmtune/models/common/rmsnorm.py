"""RMSNorm with the numerics of transformers' GLM-5 / DeepSeek-V3 norm.

The normalisation runs in fp32 and the result is cast back to the input dtype
*before* the weight multiply: in bf16 this rounding step is part of the function
the checkpoint was trained with, so it is kept for parity.

Backends (`model.norm_backend`, set on a built model by `set_norm_backend`): "torch", the
eager function below and the reference; "triton", the same roundings in one forward and one
backward kernel (`glmtune.kernels.rms_norm`), which save the input and a 1/rms per row instead
of an fp32 copy of the input (sft_4k's busiest rank: 3.1% less compute, 0.66 GiB less peak on an
H100; docs/benchmarks.md, 2026-12-06, second entry); "auto" (the default), triton for a CUDA
tensor where Triton is installed, torch otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.kernels import rms_norm as kernels
from glmtune.kernels.rms_norm import rms_norm

NORM_BACKENDS = ("auto", "torch", "triton")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda and kernels.triton is not None):
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        backend = f", backend={self.backend}" if self.backend != "auto" else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{backend}"


def set_norm_backend(model: nn.Module, backend: str) -> None:
    """Every RMSNorm of a built model computes through `backend` (NORM_BACKENDS)."""
    assert backend in NORM_BACKENDS, backend
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.backend = backend
