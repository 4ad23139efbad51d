"""`apply_fsdp` on a one-rank gloo group: bf16 layers gathered in their own dtype compute exactly
what the unsharded bf16 model computes, with routers kept in fp32 as units of their own. And the
optimizer-held fp32 masters against the fp32-master path they replaced (FSDP2 mixed precision over
fp32 parameters), rebuilt here: the same per-step losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from glmtune.models.common.microbatch import MicroBatch
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
    return model(ids, MicroBatch(ids, targets=targets), compute_logits=False).loss_sum


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


def _earlier_fp32_master_path(args, bf16_model, mesh):
    """The fp32-master path before issue 35, rebuilt here as the reference: fp32 parameters holding
    the same values, each layer and the root computing on bf16 copies (FSDP2 mixed precision; the
    routers as fp32 units of their own), gradients summed in fp32, torch's AdamW over fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(args, torch.float32, seed=1)
    model.load_state_dict(bf16_model.state_dict())  # exact: bf16 values in fp32
    compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    own = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for layer in [*model.model.layers, *model.mtp]:
        for module in layer.modules():
            if isinstance(module, Router):
                fully_shard(module, mesh=mesh, mp_policy=own)
        fully_shard(layer, mesh=mesh, mp_policy=compute)
    fully_shard(model, mesh=mesh, mp_policy=compute)
    return model


def test_optimizer_held_masters_give_the_earlier_fp32_master_path_per_step(one_rank_mesh):
    """Same start, same batches: bf16 parameters with MasterAdamW against the earlier path (fp32
    parameters, FSDP2's bf16 casts, torch's AdamW). Both compute on the same bf16 weights and read
    the same gradient values, so the losses agree to fp32 rounding step by step."""
    from glmtune.train.optim import build_optimizer

    args = get_preset("tiny")
    ours = build_model(args, torch.bfloat16, seed=0)
    earlier = _earlier_fp32_master_path(args, ours, one_rank_mesh)
    runs = [(ours, build_optimizer(ours, 1e-3, 0.01, (0.9, 0.999), 1e-8, "auto", masters=True)),
            (earlier, build_optimizer(earlier, 1e-3, 0.01, (0.9, 0.999), 1e-8, "auto"))]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab_size, (2, 48), generator=gen)] * 4  # one batch: it is learned
    losses = {0: [], 1: []}
    for side, (model, opt) in enumerate(runs):
        for ids in batches:
            loss = _loss(model, ids, torch.roll(ids, -1, dims=1)) / ids.numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[side].append(float(loss.detach()))
    assert losses[0][0] == losses[1][0]  # the same bf16 weights
    assert losses[0][3] < losses[0][0] - 0.05, losses  # lr 1e-3: it learns
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=0), losses  # measured: bit-identical
