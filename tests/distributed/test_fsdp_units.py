"""`apply_fsdp` on a one-rank gloo group: bf16 layers gathered in their own dtype compute exactly
what the unsharded bf16 model computes, with routers kept in fp32 as units of their own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import Router
from glmtune.models.glm5.parallelize import apply_fsdp


@pytest.fixture
def one_rank_mesh():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def _loss(model, ids, targets):
    return model(ids, compute_logits=False, targets=targets).loss_sum


def test_bf16_units_compute_the_unsharded_model_with_fp32_routing(one_rank_mesh):
    args = get_preset("tiny")
    plain = build_model(args, torch.bfloat16, seed=0)
    sharded = build_model(args, torch.bfloat16, seed=0)
    apply_fsdp(sharded, one_rank_mesh)

    seen: dict[str, set[torch.dtype]] = {"router": set(), "layer": set()}
    for module in sharded.modules():
        if isinstance(module, Router):
            module.register_forward_pre_hook(lambda m, _: seen["router"].add(m.weight.dtype))
    for layer in sharded.model.layers:
        layer.register_forward_pre_hook(lambda m, _: seen["layer"].add(m.self_attn.o_proj.weight.dtype))

    ids = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, dims=1)
    loss = _loss(sharded, ids, targets)
    assert seen == {"router": {torch.float32}, "layer": {torch.bfloat16}}
    assert torch.equal(loss, _loss(plain, ids, targets))  # same bf16 weights, same kernels: bit-identical
    loss.backward()
    grads = {p.grad.dtype for p in sharded.parameters() if p.grad is not None}
    assert grads == {torch.bfloat16, torch.float32}  # the parameters' own dtypes (routers fp32)

    units = {name for name, module in sharded.named_modules() if isinstance(module, FSDPModule)}
    routers = {name for name, module in sharded.named_modules() if isinstance(module, Router)}
    assert routers and routers <= units
    assert {f"mtp.{i}" for i in range(len(sharded.mtp))} <= units  # never run: never gathered with the root
