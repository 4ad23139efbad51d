"""Parameter and compute dtypes of a run (`model.dtype`, `train.master_weights`).

bf16 keeps 8 significant bits, so adding an update of size `lr` to a bf16 weight w
changes nothing once half of w's bf16 spacing exceeds lr: for lr 1e-5 that is every
|w| >= 2**-8, about 85% of N(0, 0.02) weights. AdamW's update is about lr per step,
so full fine-tuning in bf16 alone leaves most weights bit-for-bit where they started.

With fp32 master weights the parameters stay bf16, and the layers compute on them as the
bf16-only run does (the same kernels, no per-step cast); the optimizer holds an fp32 master
of each trainable bf16 parameter beside its fp32 moments, updates the master from the bf16
gradient and writes it back rounded (`glmtune/train/master_adamw.py`, one Triton kernel per
tensor on CUDA). Bytes per parameter: 16 (bf16 weight and gradient, fp32 master and two
moments) instead of 8, divided by the shard count; under FSDP2 the masters shard with their
parameters. Checkpoints hold the masters in the parameters' place, the layout of fp32
parameters (`MasterAdamW.with_masters`).

torch.autocast is not used for this: over fp32 parameters it fails in the fused loss
(a bf16 logit gradient against the fp32 head weight) and it would route tokens in
bf16, so there is no autocast setting (`train.autocast` was removed). The rules
themselves need no torch and live with the config checks
(`glmtune.config.validate.precision_errors`, `fp32_master_weights`), so that
`glmtune config validate` refuses what `glmtune train` refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from glmtune.config import JobConfig
from glmtune.config.degrees import raise_config_errors
from glmtune.config.validate import fp32_master_weights, precision_errors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CHUNK = 1 << 26  # elements compared at a time when counting (bounds the temporary memory)


@dataclass(frozen=True)
class Precision:
    param_dtype: torch.dtype  # the parameters the layers compute with (model.dtype)
    masters: bool = False  # fp32 master weights held by the optimizer for bf16 parameters

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype

    def describe(self) -> str:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.param_dtype]
        return f"{name} parameters and compute" + (", fp32 master weights in the optimizer" if self.masters else "")


def resolve_precision(cfg: JobConfig) -> Precision:
    """The run's dtypes; a ValueError naming the keys for a combination that cannot work."""
    raise_config_errors(precision_errors(cfg))
    dtype = DTYPES[cfg.model.dtype]
    return Precision(dtype, masters=fp32_master_weights(cfg) and dtype != torch.float32)


def rounding_threshold(lr: float) -> float:
    """The smallest power of two T such that an update of size lr rounds away on every
    bf16 weight with |w| >= T (half of its spacing 2**(floor(log2|w|) - 7) exceeds lr)."""
    return 2.0 ** (math.floor(math.log2(lr)) + 9)


@torch.no_grad()
def bf16_rounded_away(model: nn.Module, lr: float) -> float | None:
    """Share of the trainable bf16 weights on which an update of size `lr` rounds away
    (all ranks' shards together; a collective when distributed). None: no trainable bf16."""
    threshold = rounding_threshold(lr)
    device = next(model.parameters()).device
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # (rounded away, total)
    for param in model.parameters():
        if not param.requires_grad or param.dtype != torch.bfloat16:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
        flat = local.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            counts[0] += torch.count_nonzero(flat[start : start + _CHUNK].abs() >= threshold)
        counts[1] += flat.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    rounded, total = counts.tolist()
    return rounded / total if total else None


def bf16_only_warning(fraction: float, lr: float) -> str:
    """What bf16-only parameters cost at this lr: the share of weights whose updates round away."""
    exponent = int(math.log2(rounding_threshold(lr)))
    most = "most bf16 weights do not move: " if fraction > 0.5 else ""
    return (f"train.master_weights: none trains bfloat16 parameters only: at optim.lr {lr:g} {most}"
            f"{fraction:.0%} of updates round away (an AdamW step is at most about lr, less than half the bf16 "
            f"spacing of every |w| >= 2^{exponent}). train.master_weights: fp32 moves every weight, for 16 instead "
            "of 8 bytes per parameter divided by the shard count")
