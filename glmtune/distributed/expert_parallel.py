"""Expert parallelism (EP): each MoE layer's routed experts split over an `ep` mesh axis.

`apply_expert_parallel(model, ep_mesh)` transforms a built model in place, for every MoE
layer (the MTP layer's included). It knows no model family: a MoE layer is any module that
implements the routed-experts layer contract of `glmtune/models/common/token_dispatch.py`
(`dispatcher`, `experts`, `num_experts`; found by `expert_layers`):
- every parameter of the routed-experts module ([E, ...]: `gate_up_proj`, `down_proj`,
  and LoRA adapters if present) becomes a DTensor placed `Shard(0)` on the ep mesh: rank r
  keeps experts [r*L, (r+1)*L), L = E / ep. Checkpoints (DCP) therefore record the
  global [E, ...] shape and can be loaded at another ep;
- the experts' forward computes on the local shards (plain tensors), so the model's
  grouped GEMM runs unchanged on L experts;
- the layer's token dispatcher becomes an ep dispatcher (`glmtune/distributed/token_exchange.py`),
  chosen by name from `DISPATCHERS`.

Gradients: an expert's gradient is complete on the rank that holds it (the tokens of
every rank reached it), so expert gradients are never reduced over `ep`; the other
parameters' gradients are per rank and reduced over the data-parallel ranks as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from glmtune.config.degrees import expert_split_errors, raise_config_errors
from glmtune.distributed.token_exchange import AllGatherTokenDispatcher, AllToAllTokenDispatcher
from glmtune.models.common.token_dispatch import LocalTokenDispatcher, TokenDispatcher, expert_layers

# The plug-in point for token movement: a name -> a builder called with the ep mesh, the
# number of local experts and the layer's current local dispatcher (whose backend the
# builder may keep). A DeepEP or HybridEP dispatcher (fused NVLink/RDMA kernels, one
# buffer per ep group; CUDA only) would register here as "deepep"/"hybridep" by
# implementing `TokenDispatcher.dispatch`/`combine` with the same row order.
DispatcherBuilder = Callable[[DeviceMesh, int, LocalTokenDispatcher], TokenDispatcher]
DISPATCHERS: dict[str, DispatcherBuilder] = {
    "all_to_all": lambda mesh, num_local, local: AllToAllTokenDispatcher(mesh, num_local, local),
    "all_gather": lambda mesh, num_local, local: AllGatherTokenDispatcher(mesh, num_local),
}


def register_dispatcher(name: str, builder: DispatcherBuilder) -> None:
    """Make `apply_expert_parallel(..., dispatcher=name)` use `builder`."""
    DISPATCHERS[name] = builder


def _forward_on_local_shards(experts: nn.Module, forward, *args, **kwargs):
    # The parameters are ep-sharded DTensors (already unsharded by FSDP2's pre-forward hook
    # when FSDP2 wraps this module; that is why this runs inside the experts' own forward).
    # The grouped GEMM wants the local experts as plain tensors: swap them in for this call.
    # `to_local` is differentiable, so the gradient lands on the DTensor as Shard(0).
    params = experts._parameters
    sharded = dict(params)
    for name, param in sharded.items():
        if isinstance(param, DTensor):
            params[name] = param.to_local()
    try:
        return forward(*args, **kwargs)
    finally:
        params.update(sharded)


def _shard_experts(experts: nn.Module, ep_mesh: DeviceMesh, num_experts: int) -> None:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    num_local = num_experts // ep
    for name, param in list(experts.named_parameters(recurse=False)):
        assert param.shape[0] == num_experts, (name, tuple(param.shape))
        # Each rank keeps its own slice, no communication: the full tensor is the same on
        # every rank (same seed or same checkpoint) or on the meta device, to be loaded later.
        local = param.detach().narrow(0, rank * num_local, num_local).clone()
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                     shape=param.shape, stride=param.stride())
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.forward = functools.partial(_forward_on_local_shards, experts, experts.forward)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatcher: str = "all_to_all") -> nn.Module:
    """Shard every MoE layer's routed experts over `ep_mesh` and install an ep dispatcher.

    Args:
        model: a built model; its MoE layers (`expert_layers`) still have their local dispatcher.
        ep_mesh: 1-D mesh of the ranks that share one copy of the experts.
        dispatcher: a name in `DISPATCHERS` ("all_to_all" or the "all_gather" reference).

    An ep of 1 leaves the model as it is.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"expert-parallel dispatcher {dispatcher!r} unknown; choose from {sorted(DISPATCHERS)}")
    assert ep_mesh.ndim == 1, f"an ep mesh is 1-D, got {ep_mesh.mesh_dim_names}"
    ep = ep_mesh.size()
    moe_layers = expert_layers(model)
    for moe in moe_layers:
        raise_config_errors(expert_split_errors(ep, moe.num_experts))
        if not isinstance(moe.dispatcher, LocalTokenDispatcher):
            raise ValueError("apply_expert_parallel: the model is already expert-parallel")
    if ep == 1:
        return model
    for moe in moe_layers:
        _shard_experts(moe.experts, ep_mesh, moe.num_experts)
        moe.dispatcher = DISPATCHERS[dispatcher](ep_mesh, moe.num_experts // ep, moe.dispatcher)
    return model
