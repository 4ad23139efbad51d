"""Expert parallelism hides the all-to-alls behind compute (issue 50's overlap), on CPU.

Two gloo ranks run one GLM-5 MoE layer (tiny, all-to-all dispatcher, ep 2) forward and backward
under the torch profiler, and the order of what it issued is read from it: the rows'
all-to-alls (the dispatcher's transfers' issue and wait, marked as profiler ranges) and markers
for the shared experts (forward: their projections; backward: their weights' gradients
accumulated) and the routed experts' forward. Each all-to-all must have shared-expert work
between its issue and its wait, forward and backward: the shared experts run while the rows
are in flight. No timing is read: only the order. The counts' all-to-all (waited at once: its
host sync sizes the rows' exchange) is not in the lists.

With `overlap_chunks` 2 the layer's tokens go in two chunks: both chunks' rows are sent before
the first chunk's experts compute (chunk 1's rows in flight meanwhile), and the tiny model's
loss and every gradient equal the one-chunk run's within the layouts' tolerance
(`layout_tolerances.LOSS_REL`), its recorded tokens per expert exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from glmtune.config.schema import ParallelConfig
from glmtune.distributed.expert_parallel import apply_expert_parallel
from glmtune.distributed.mesh import ParallelMesh
from glmtune.distributed import token_exchange
from glmtune.distributed.token_exchange import AllToAllTokenDispatcher
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import MoE
from glmtune.models.glm5.parallelize import parallelize_glm5
from tests.distributed.gloo_helpers import run_gloo
from tests.distributed.layout_tolerances import LOSS_REL

NAMES = {"ep_all_to_all_issue": "all_to_all", "ep_all_to_all_wait": "wait", "shared": "shared", "experts": "experts"}


def _mark(name: str) -> None:
    with record_function(name):
        pass


def _marked(method, name: str):
    """`method` inside a profiler range `name` (the dispatcher's transfers, marked in the ranks
    of this test only: a range inside a checkpointed region would upset selective AC)."""
    def call(*args):
        with record_function(name):
            return method(*args)
    return call


def _issue_order(moe: MoE, x_BSD: torch.Tensor) -> dict[str, list[str]]:
    """The layer's forward and backward as what they issued, in order: all_to_all, wait,
    shared (a shared-expert projection, or in backward its weight's gradient), experts."""
    shared = moe.shared_experts
    hooks = [moe.experts.register_forward_pre_hook(lambda *_: _mark("experts"))]
    hooks += [linear.register_forward_pre_hook(lambda *_: _mark("shared"))
              for linear in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    hooks += [linear.weight.register_post_accumulate_grad_hook(lambda _: _mark("shared"))
              for linear in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    orders = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = moe(x_BSD)
    orders["forward"] = [NAMES[e.name] for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                         if e.name in NAMES]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    orders["backward"] = [NAMES[e.name] for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                          if e.name in NAMES]
    for hook in hooks:
        hook.remove()
    return orders


def _loss_and_grads(model, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """The tiny model's loss and gradients (expert shards as they are) on this rank's micro-batch,
    and each MoE layer's recorded tokens per expert."""
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, 4000, (1, 9 + 8 * rank), generator=generator)
    loss = model(ids, MicroBatch(ids, targets=ids.roll(-1, 1))).loss_sum
    loss.backward()
    grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for name, p in model.named_parameters() if p.grad is not None}
    tokens = {name: m.tokens_per_expert.clone() for name, m in model.named_modules() if isinstance(m, MoE)}
    return {"values": {"loss": loss.detach(), **grads}, "tokens": tokens}


def _set_chunks(model, chunks: int) -> None:
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.dispatcher = AllToAllTokenDispatcher(moe.dispatcher.ep.group, moe.dispatcher.ep.num_local_experts,
                                                     moe.dispatcher.local, overlap_chunks=chunks)


def _overlap_worker(rank: int, world: int, out_dir) -> None:
    token_exchange._Transfer.issue = _marked(token_exchange._Transfer.issue, "ep_all_to_all_issue")
    token_exchange._Transfer.wait = _marked(token_exchange._Transfer.wait, "ep_all_to_all_wait")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = apply_expert_parallel(build_model(get_preset("tiny"), seed=0, attention_backend="eager"), mesh)
    moe = model.model.layers[2].mlp
    assert isinstance(moe, MoE)
    x_BSD = torch.randn(1, 11 + 4 * rank, get_preset("tiny").hidden_size, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)  # a layer input: its gradient goes back through the dispatch
    orders = {1: _issue_order(moe, x_BSD)}
    one_chunk = _loss_and_grads(model, rank)
    _set_chunks(model, 2)
    orders[2] = _issue_order(moe, x_BSD)
    two_chunks = _loss_and_grads(model, rank)
    (out_dir / f"order{rank}.json").write_text(json.dumps(orders))
    # parallelize_glm5 installs the chunks on every expert layer, and refuses the all_gather dispatcher.
    mesh = ParallelMesh.from_config(ParallelConfig(ep=world), world_size=world)
    chunked = parallelize_glm5(build_model(get_preset("tiny"), seed=0), mesh=mesh, ep_overlap_chunks=3)
    assert [m.dispatcher.overlap_chunks for m in chunked.modules() if isinstance(m, MoE)] == [3, 3, 3]
    # Recomputed in backward (full activation checkpointing), the transfers run again, apart
    # from the backward's own: the same loss and gradients.
    runs = {ac: _loss_and_grads(parallelize_glm5(build_model(get_preset("tiny"), seed=0, attention_backend="eager"),
                                                 mesh=mesh, activation_checkpointing=ac, ep_overlap_chunks=2), rank)
            for ac in ("none", "full")}
    torch.save(runs, out_dir / f"checkpointed{rank}.pt")
    with pytest.raises(ValueError, match="ep_overlap_chunks 2: .* all_to_all dispatcher"):
        parallelize_glm5(build_model(get_preset("tiny"), seed=0), mesh=mesh, ep_dispatcher="all_gather",
                         ep_overlap_chunks=2)
    torch.save({"one": one_chunk, "two": two_chunks}, out_dir / f"runs{rank}.pt")


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    """Both ranks' op orders and runs, one gloo run shared by the tests."""
    out_dir = tmp_path_factory.mktemp("ep_overlap")
    run_gloo(_overlap_worker, 2, out_dir, out_dir, timeout_s=120)
    return out_dir


def test_shared_experts_run_while_the_rows_all_to_alls_are_in_flight(ranks_dir):
    for rank in range(2):
        orders = json.loads((ranks_dir / f"order{rank}.json").read_text())["1"]
        # The dispatch's rows sent, the shared experts' gate and up projections, then the wait;
        # the experts; the outputs sent back, the shared down projection, then the wait.
        assert orders["forward"] == ["all_to_all", "shared", "shared", "wait", "experts",
                                     "all_to_all", "shared", "wait"], (rank, orders)
        # Backward mirrors it: the outputs' gradient sent back while down_proj's gradient is
        # formed, the rows' gradient while gate and up's are.
        assert orders["backward"] == ["all_to_all", "shared", "wait",
                                      "all_to_all", "shared", "shared", "wait"], (rank, orders)


def test_two_chunks_overlap_each_others_all_to_alls_and_equal_one_chunk(ranks_dir):
    tmp_path, worst = ranks_dir, 0.0
    for rank in range(2):
        orders = json.loads((tmp_path / f"order{rank}.json").read_text())["2"]
        # Both chunks' rows sent before chunk 0's experts, so chunk 1's travel meanwhile; chunk
        # 0's outputs sent back before chunk 1's rows are waited for and travel while chunk 1's
        # experts compute.
        assert orders["forward"] == ["all_to_all", "all_to_all", "shared", "shared", "wait", "experts",
                                     "all_to_all", "wait", "experts", "all_to_all", "shared", "wait", "wait"], \
            (rank, orders)
        # Backward: both chunks' output gradients sent before either is waited for; chunk 1's
        # rows' gradient sent before chunk 0's output gradient is waited for.
        assert orders["backward"] == ["all_to_all", "all_to_all", "shared", "wait", "all_to_all", "wait",
                                      "all_to_all", "shared", "shared", "wait", "wait"], (rank, orders)
        runs = torch.load(tmp_path / f"runs{rank}.pt")
        one, two = runs["one"], runs["two"]
        assert sorted(one["values"]) == sorted(two["values"])
        assert any(".experts.down_proj" in name for name in one["values"]), sorted(one["values"])
        for name, expected in one["values"].items():
            scale = max(expected.abs().max().item(), 1e-30) if expected.numel() else 1.0
            rel = (two["values"][name] - expected).abs().max().item() / scale if expected.numel() else 0.0
            assert rel <= LOSS_REL, (name, rel)
            worst = max(worst, rel)
        assert len(one["tokens"]) == 3  # two decoder layers and the MTP layer
        for name, expected in one["tokens"].items():
            assert torch.equal(two["tokens"][name], expected), name
    print(f"\ntwo chunks vs one: worst relative difference of the loss and any gradient {worst:.2e}")


@pytest.mark.parametrize("chunks", [0, 2])
def test_overlap_chunks_without_expert_parallelism_are_refused(chunks):
    with pytest.raises(ValueError, match=f"ep_overlap_chunks {chunks}: .* needs ep > 1"):
        parallelize_glm5(build_model(get_preset("tiny"), seed=0), ep_overlap_chunks=chunks)


def test_recomputed_transfers_give_the_same_gradients(ranks_dir):
    for rank in range(2):
        runs = torch.load(ranks_dir / f"checkpointed{rank}.pt")
        plain, recomputed = runs["none"]["values"], runs["full"]["values"]
        assert sorted(plain) == sorted(recomputed) and len(plain) > 10
        for name, expected in plain.items():
            assert torch.equal(recomputed[name], expected), (rank, name)
