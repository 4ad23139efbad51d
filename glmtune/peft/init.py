"""Initial values of the LoRA adapters, the same wherever and however the model is placed.

A is kaiming-uniform per (expert) matrix, fan_in = its input width (U(-1/sqrt(in),
1/sqrt(in)), PEFT's initialisation); B is zero, so a fresh adapter leaves the model's
output unchanged. The values are drawn on the CPU from one generator, adapter after
adapter in module order, for the *whole* (unsharded) tensor; a rank of a sharded model
then keeps the part its local shard holds. So a one-process run on a GPU, a run on the
CPU and a run built on the meta device, parallelized over FSDP2 and expert parallelism
and materialized afterwards (`glmtune train` under torchrun from an HF checkpoint) start
from the same adapters, bit for bit.

Host memory is one adapter tensor at a time (a routed-expert A of GLM-5 at rank 32:
256 x 32 x 6144 fp32 = 200 MB).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from glmtune.checkpoint.sharded_load import local_indices
from glmtune.peft.lora import EXPERT_PARAMS, LoRAGroupedExperts, LoRALinear, init_pair, lora_modules


def adapter_pairs(model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name of A, A, B) of every adapter of `model`, in module order."""
    pairs = []
    for name, module in lora_modules(model):
        if isinstance(module, LoRALinear):
            pairs.append((f"{name}.lora_A.weight", module.lora_A.weight, module.lora_B.weight))
            continue
        assert isinstance(module, LoRAGroupedExperts)
        for proj in EXPERT_PARAMS:
            pair = module.adapter(proj)
            if pair is not None:
                short = proj.removesuffix("_proj")
                pairs.append((f"{name}.lora_{short}_A", *pair))
    return pairs


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """State-dict keys of the adapters (what an HF base checkpoint does not hold)."""
    return {name for name, _ in model.named_parameters() if ".lora_" in name}


@torch.no_grad()
def reset_lora_parameters(model: nn.Module, seed: int | None = None) -> None:
    """Give every adapter of `model` its initial values (A kaiming-uniform, B zero).

    Args:
        model: carries LoRA modules (`apply_lora`); plain tensors or DTensors (sharded over
            any mesh), on any device but meta.
        seed: seeds the generator the A matrices are drawn from; None draws from the
            global CPU generator (advancing it).
    """
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    for name, a, b in adapter_pairs(model):
        assert not a.is_meta, f"{name} is on the meta device: materialize the model first"
        full = torch.empty(tuple(a.shape), dtype=torch.float32)
        init_pair(full, _local(b), generator)
        _local(a).copy_(_local_part(full, a))


@torch.no_grad()
def set_whole_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give `param` (a plain tensor, or a DTensor sharded over any mesh) the global value `full`:
    each rank copies the part its local shard holds."""
    _local(param).copy_(_local_part(full, param))


def _local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the global `full` that `like`'s local shard holds."""
    if not isinstance(like, DTensor):
        return full
    for dim, index in enumerate(local_indices(like)):
        full = full.index_select(dim, index)
    return full


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
