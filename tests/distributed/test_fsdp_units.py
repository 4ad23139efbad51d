"""`apply_fsdp` in one process (a one-rank gloo group): fp32 master weights compute exactly
what the bf16 model computes, with routers kept in fp32 as units of their own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import Router
from glmtune.distributed.process_group import one_rank_process_group
from glmtune.models.glm5.parallelize import parallelize_glm5


@pytest.fixture
def one_rank_group():
    created = one_rank_process_group("cpu")
    yield
    if created:
        dist.destroy_process_group()


def _loss(model, ids, targets):
    return model(ids, compute_logits=False, targets=targets).loss_sum


def test_fp32_masters_compute_the_bf16_model_with_fp32_routing(one_rank_group):
    args = get_preset("tiny")
    bf16 = build_model(args, torch.bfloat16, seed=0)
    masters = build_model(args, torch.float32, seed=1)
    masters.load_state_dict(bf16.state_dict())  # the same values, held in fp32
    parallelize_glm5(masters, compute_dtype=torch.bfloat16)

    seen: dict[str, set[torch.dtype]] = {"router": set(), "layer": set()}
    for module in masters.modules():
        if isinstance(module, Router):
            module.register_forward_pre_hook(lambda m, _: seen["router"].add(m.weight.dtype))
    for layer in masters.model.layers:
        layer.register_forward_pre_hook(lambda m, _: seen["layer"].add(m.self_attn.o_proj.weight.dtype))

    ids = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, dims=1)
    loss = _loss(masters, ids, targets)
    assert seen == {"router": {torch.float32}, "layer": {torch.bfloat16}}
    assert torch.equal(loss, _loss(bf16, ids, targets))  # same bf16 weights, same kernels: bit-identical
    loss.backward()
    assert {p.grad.dtype for p in masters.parameters() if p.grad is not None} == {torch.float32}
    assert {p.dtype for p in masters.parameters()} == {torch.float32}

    units = {name for name, module in masters.named_modules() if isinstance(module, FSDPModule)}
    routers = {name for name, module in masters.named_modules() if isinstance(module, Router)}
    assert routers and routers <= units
    assert {f"mtp.{i}" for i in range(len(masters.mtp))} <= units  # never run: never gathered with the root
