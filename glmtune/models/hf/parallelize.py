"""`parallelize_hf`: an `hf` family model made training-ready, in the order GLM-5's plan uses.

  1. activation checkpointing - "full": every decoder layer recomputed in backward, through
                                transformers' own mechanism (`gradient_checkpointing_enable`,
                                non-reentrant); "selective" is not offered yet (refused)
  2. torch.compile            - per decoder layer
  3. FSDP2 (`fully_shard`)    - per decoder layer, then the root (embedding, final norm, head);
                                HSDP when the mesh replicates

Gradient arithmetic as GLM-5's (models/glm5/parallelize.py `apply_fsdp`): the trainer divides each
rank's loss sum by the step's global supervised tokens, so every unit sums gradients (divide factor
1, sum-only collectives), in fp32, parameters gathered in their own dtype.

Expert, pipeline and context parallelism are refused: transformers' modules are not laid out for
them (experts are one stacked parameter per layer, the decoder runs as one loop, attention sees
whole rows).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from glmtune.models.hf.model import FSDP_RUN, call_on, decoder_layers


def refuse_unsupported(mesh) -> None:
    """EP, PP and CP > 1 refused in one sentence (module docstring)."""
    if mesh is None:
        return
    asked = [f"{axis}={mesh.size(axis)}" for axis in ("ep", "pp", "cp") if mesh.size(axis) > 1]
    if asked:
        raise ValueError(f"parallel: {', '.join(asked)} is not available for the hf family (transformers' modules are "
                         "not laid out for expert, pipeline or context parallelism); use data parallelism (FSDP2/HSDP)")


def apply_fsdp(model: nn.Module, mesh, reduce_dtype: torch.dtype = torch.float32) -> None:
    own_dtype = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=own_dtype)
    fully_shard(model, mesh=mesh, mp_policy=own_dtype)
    # the loss calls the decoder and the head's weight, not the model's forward (model.py `FSDP_RUN`)
    setattr(model, FSDP_RUN, functools.partial(call_on, model))
    register_fsdp_forward_method(model, FSDP_RUN)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize_hf(model: nn.Module, *, mesh=None, activation_checkpointing: str = "none", compile: bool = False,
                   reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """AC -> compile -> FSDP2 (module docstring); `mesh` is the run's `ParallelMesh` (None: one process)."""
    refuse_unsupported(mesh)
    if activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif activation_checkpointing != "none":
        raise ValueError(f"parallel.activation_checkpointing={activation_checkpointing!r} is not available for the "
                         "hf family yet; choose none or full")
    if compile:
        for layer in decoder_layers(model):
            layer.compile()
    if mesh is not None and mesh.degrees.fsdp_applies():
        apply_fsdp(model, mesh.fsdp_mesh(), reduce_dtype)
    return model
