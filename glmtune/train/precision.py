"""Parameter and compute dtypes of a run (`model.dtype`, `train.master_weights`).

bf16 keeps 8 significant bits, so adding an update of size `lr` to a bf16 weight w
changes nothing once half of w's bf16 spacing exceeds lr: for lr 1e-5 that is every
|w| >= 2**-8, about 85% of N(0, 0.02) weights. AdamW's update is about lr per step,
so full fine-tuning in bf16 alone leaves most weights bit-for-bit where they started.

With fp32 master weights the parameters (what AdamW updates and checkpoints hold)
are fp32 and the layers compute on bf16 copies: FSDP2's mixed precision
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), applied by
`parallelize_glm5` in one process too, on a one-rank mesh. The copies are made per
layer and freed after it, so the layers run the bf16 model's kernels and numerics;
the cost is 16 instead of 8 bytes per parameter (fp32 parameter, gradient and AdamW
moments), divided by the shard count.

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
    param_dtype: torch.dtype  # the parameters: built in, updated by AdamW, checkpointed
    compute_dtype: torch.dtype  # what the layers compute in (model.dtype)

    @property
    def mixed(self) -> bool:
        """fp32 parameters with bf16 compute: FSDP2 casts them per layer, one process included."""
        return self.param_dtype != self.compute_dtype

    def describe(self) -> str:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        if self.mixed:
            return f"{name[self.param_dtype]} master weights, {name[self.compute_dtype]} compute"
        return f"{name[self.param_dtype]} parameters and compute"


def resolve_precision(cfg: JobConfig) -> Precision:
    """The run's dtypes; a ValueError naming the keys for a combination that cannot work."""
    raise_config_errors(precision_errors(cfg))
    compute = DTYPES[cfg.model.dtype]
    return Precision(torch.float32 if fp32_master_weights(cfg) else compute, compute)


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
