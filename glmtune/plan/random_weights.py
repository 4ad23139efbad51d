"""Random weights for a model laid out on the meta device, in the checkpoint's dtypes, made on
its device: what `glmtune plan --measure` trains instead of a checkpoint.

After `parallelize` each parameter is this rank's shard (a DTensor's local tensor); it is
materialized (`to_empty`) and filled in place, shard by shard, so no rank-sized host copy
and no whole tensor ever exists:

  * floating matrices (2-D and up): normal(0, std), std the family's initializer range;
  * vectors (norm weights): ones;
  * persistent buffers (a router's correction bias): zeros, as a fresh model has them;
  * e4m3 weights (an FP8 base): normal(0, 1) rounded to e4m3, and their block scales
    (`*_scale_inv`, the FP8 checkpoints' name) std, so the dequantized weight is ~normal(0, std);
  * LoRA adapters as any matrix (B not zero: a step in, as training is); non-persistent
    buffers as the family's sharded load sets them.

The values only need to be finite and of realistic scale: the measurement is of memory and
time, which do not depend on them (the routing does, and a random router routes about evenly:
say so where routing matters).
"""

from __future__ import annotations

import torch
from torch import nn

from collections.abc import Callable

_CHUNK_ELEMENTS = 1 << 26  # e4m3 filled through a bf16 temporary this many elements at a time


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def fill_random_weights(model: nn.Module, device: torch.device, std: float, seed: int,
                        reset_buffers: Callable[[nn.Module], None]) -> None:
    """Materialize `model` (meta, possibly parallelized) on `device` with random weights (module docstring);
    `reset_buffers`: the family's (`Weights.reset_buffers`: rotary frequencies as at construction)."""
    model.to_empty(device=device)
    generator = torch.Generator(device=device)
    for index, (name, param) in enumerate(model.named_parameters()):
        local = _local(param.data)
        # Each tensor's shard starts the same stream on every rank: the shards of a data-parallel
        # world are then pieces of one periodic tensor (what a loopback all-gather builds).
        generator.manual_seed(seed * 1_000_003 + index)
        if local.numel() == 0:
            continue
        if local.dtype == torch.float8_e4m3fn:
            flat = local.view(-1)
            for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
                part = flat[start:start + _CHUNK_ELEMENTS]
                part.copy_(torch.randn(part.shape, generator=generator, device=device, dtype=torch.bfloat16))
        elif name.endswith("scale_inv"):
            local.fill_(std)
        elif local.dim() >= 2:
            local.normal_(0.0, std, generator=generator)
        else:
            local.fill_(1.0)
    persistent = set(model.state_dict().keys())
    for name, buffer in model.named_buffers():
        if name in persistent:
            _local(buffer).zero_()
    reset_buffers(model)
