"""Expert parallelism on CPU (gloo, 2 and 4 processes) against one process, tiny model, fp32.

Every rank builds the same model, shards its experts with `apply_expert_parallel`, and
runs forward + backward on its OWN micro-batch (ranks differ in length, one has 3
tokens). One process running all ranks' micro-batches is the reference: the summed loss
and every parameter's gradient (expert gradients gathered from their shards, the others
summed over ranks) must match it to 1e-5 relative (max |diff| / max |reference|), for
the all-to-all and the all-gather dispatcher, and the two must match each other.

Scenarios: "uneven" (natural routing: some rank routes no token to some expert) and
"starved" (a selection bias of -100 on experts 0 and 1: no token reaches them; at ep 4
rank 0 computes no row at all).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from glmtune.distributed.expert_parallel import apply_expert_parallel
from glmtune.distributed.token_exchange import AllGatherTokenDispatcher, AllToAllTokenDispatcher
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.token_dispatch import LocalTokenDispatcher
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import MoE
from tests.distributed.gloo_helpers import run_gloo

SCENARIOS = ("uneven", "starved")
DISPATCHER_CLASSES = {"all_to_all": AllToAllTokenDispatcher, "all_gather": AllGatherTokenDispatcher}
SHAPES = [(1, 29), (1, 3), (2, 9), (1, 17)]  # (rows, sequence length) of rank r's micro-batch
NUM_EXPERTS = get_preset("tiny").n_routed_experts
TOLERANCE = 1e-5


def _model(scenario: str):
    model = build_model(get_preset("tiny"), seed=0, attention_backend="eager")
    if scenario == "starved":
        for module in model.modules():
            if isinstance(module, MoE):
                module.gate.e_score_correction_bias[[0, 1]] = -100.0
    return model


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, 4000, SHAPES[rank], generator=generator)
    targets = torch.randint(0, 4000, SHAPES[rank], generator=generator)
    targets[:, ::4] = -100
    return ids, targets


def _forward_backward(model, rank: int):
    """loss_sum; per MoE layer: the router's top-k counts and the recorded `tokens_per_expert`."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and not name.startswith("mtp.")]
    routed = {}
    hooks = [m.gate.register_forward_hook(
        lambda _m, _in, out, name=name: routed.__setitem__(name, torch.bincount(out[2].reshape(-1), minlength=NUM_EXPERTS)))
        for name, m in layers]
    ids, targets = _batch(rank)
    loss = model(ids, MicroBatch(ids, targets=targets)).loss_sum
    loss.backward()
    for hook in hooks:
        hook.remove()
    recorded = {name: m.tokens_per_expert.clone() for name, m in layers}
    return loss.detach(), routed, recorded


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.double().abs().max().item() if b.numel() else 0.0
    return diff, diff / scale if scale else diff


def _check_sharded(model, ep: int, dispatcher: str) -> None:
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moe_layers) == 3  # two decoder layers and the MTP layer
    for moe in moe_layers:
        assert type(moe.dispatcher) is DISPATCHER_CLASSES[dispatcher]
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(moe.experts, name)
            assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
            assert param.shape[0] == NUM_EXPERTS and param.to_local().shape[0] == NUM_EXPERTS // ep


def _gathered_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if isinstance(param.grad, DTensor):
            grads[name] = param.grad.full_tensor()  # expert shards: complete on their rank
        else:
            grad = param.grad.clone()
            dist.all_reduce(grad)  # the data-parallel sum of per-rank gradients
            grads[name] = grad
    return grads


def _check_refusals(mesh, world: int) -> None:
    # An ep that does not divide the experts is refused before anything changes.
    odd = get_preset("tiny").replace(n_routed_experts=2 * world + 1, n_group=1, topk_group=1)
    model = build_model(odd, device="meta")
    with pytest.raises(ValueError, match=r"parallel\.ep \(%d\) must divide" % world):
        apply_expert_parallel(model, mesh)
    assert all(isinstance(m.dispatcher, LocalTokenDispatcher) for m in model.modules() if isinstance(m, MoE))
    with pytest.raises(ValueError, match="deepep"):
        apply_expert_parallel(model, mesh, dispatcher="deepep")
    # Meta-device models shard too (each rank then materializes and loads its own experts).
    meta = apply_expert_parallel(build_model(get_preset("tiny"), device="meta"), mesh)
    assert meta.model.layers[2].mlp.experts.down_proj.to_local().shape[0] == NUM_EXPERTS // world
    with pytest.raises(ValueError, match="already expert-parallel"):
        apply_expert_parallel(meta, mesh)
    # ep = 1 leaves the model alone.
    one = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep"))["ep"]
    plain = apply_expert_parallel(build_model(get_preset("tiny"), device="meta"), one)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())


def _ep_worker(rank: int, world: int, out_dir) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    _check_refusals(mesh, world)
    results = {}
    for scenario in SCENARIOS:
        base = _model(scenario)
        for dispatcher in DISPATCHER_CLASSES:
            model = apply_expert_parallel(copy.deepcopy(base), mesh, dispatcher)
            _check_sharded(model, world, dispatcher)
            loss, routed, recorded = _forward_backward(model, rank)
            for name in routed:  # the buffer holds this rank's routing over all experts
                assert torch.equal(recorded[name], routed[name].float()), (scenario, dispatcher, name)
            losses = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(losses, loss)
            counts = torch.stack([routed[name] for name in sorted(routed)])
            all_counts = [torch.zeros_like(counts) for _ in range(world)]
            dist.all_gather(all_counts, counts)
            results[scenario, dispatcher] = {"losses": torch.stack(losses), "grads": _gathered_grads(model),
                                             "counts": torch.stack(all_counts)}  # [rank, layer, expert]
    if rank == 0:
        torch.save(results, out_dir / "results.pt")


def _reference(scenario: str, world: int):
    """One process, every rank's micro-batch: losses, summed gradients, routing counts."""
    model = _model(scenario)
    losses, counts = [], []
    for rank in range(world):
        loss, routed, recorded = _forward_backward(model, rank)
        losses.append(loss)
        counts.append(torch.stack([recorded[name] for name in sorted(recorded)]))
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads, torch.stack(counts)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(tmp_path, world):
    run_gloo(_ep_worker, world, tmp_path, tmp_path, timeout_s=180)
    results = torch.load(tmp_path / "results.pt")
    worst = {}
    for scenario in SCENARIOS:
        ref_losses, ref_grads, ref_counts = _reference(scenario, world)
        for dispatcher in DISPATCHER_CLASSES:
            got = results[scenario, dispatcher]
            # tokens_per_expert on each rank == that micro-batch's routing in one process.
            assert torch.equal(got["counts"].float(), ref_counts), (scenario, dispatcher)
            figures = [_rel(got["losses"], ref_losses), _rel(got["losses"].sum(), ref_losses.sum())]
            assert sorted(got["grads"]) == sorted(ref_grads)
            assert any(".experts.gate_up_proj" in name for name in ref_grads)
            for name, ref in ref_grads.items():
                figures.append(_rel(got["grads"][name], ref))
                assert figures[-1][1] <= TOLERANCE, (scenario, dispatcher, name, figures[-1])
            assert all(rel <= TOLERANCE for _, rel in figures[:2]), (scenario, dispatcher, figures[:2])
            worst[scenario, dispatcher] = max(figures, key=lambda f: f[1])
        a2a, ag = results[scenario, "all_to_all"], results[scenario, "all_gather"]
        between = [_rel(a2a["losses"], ag["losses"])] + [_rel(a2a["grads"][n], ag["grads"][n]) for n in ref_grads]
        assert all(rel <= TOLERANCE for _, rel in between), scenario
        worst[scenario, "a2a vs all_gather"] = max(between, key=lambda f: f[1])

        counts = ref_counts.long()  # [rank, layer, expert]
        if scenario == "uneven":  # some rank sends no token to an expert that others use
            assert ((counts == 0) & (counts.sum(0, keepdim=True) > 0)).any()
        else:  # experts 0 and 1 get no token from anyone; the rest still do
            assert counts[..., :2].sum() == 0 and (counts[..., 2:].sum(0) > 0).any()
            got_grads = results[scenario, "all_to_all"]["grads"]
            assert got_grads["model.layers.2.mlp.experts.down_proj"][:2].abs().max() == 0
    print(f"\nep {world}: worst (max abs diff, rel) per case: {worst}")
