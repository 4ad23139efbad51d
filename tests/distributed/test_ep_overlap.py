"""Expert parallelism hides the all-to-alls behind the shared experts (issue 50's overlap), on CPU.

Two gloo ranks run one GLM-5 MoE layer (tiny, all-to-all dispatcher, ep 2) forward under the
torch profiler, and the order in which ops were issued is read from it: each all-to-all that
carries rows (`_c10d_functional::all_to_all_single`, the dispatch's and the combine's) must
have a shared-expert projection issued between it and its `_c10d_functional::wait_tensor`,
i.e. the shared experts run while the rows are in flight. No timing is read: only the order.
The counts' all-to-all (waited at once: its host sync sizes the rows' exchange) is left out.

With `overlap_chunks` 2 the layer's tokens go in two chunks: both chunks' rows are sent before
the first chunk's experts compute (chunk 1's rows in flight meanwhile), and the tiny model's
loss and every gradient equal the one-chunk run's within the layouts' tolerance
(`layout_tolerances.LOSS_REL`), its recorded tokens per expert exactly.

Backward is not asserted: torch's all-to-all backward (`all_to_all_single_backward` in
`torch/distributed/_functional_collectives.py`) waits inside its autograd node, so nothing
overlaps it, in any schedule (docs/parallelism.md).
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
from glmtune.distributed.token_exchange import AllToAllTokenDispatcher
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import MoE
from glmtune.models.glm5.parallelize import parallelize_glm5
from tests.distributed.gloo_helpers import run_gloo
from tests.distributed.layout_tolerances import LOSS_REL

ALL_TO_ALL = "_c10d_functional::all_to_all_single"
WAIT = "_c10d_functional::wait_tensor"


def _issue_order(moe: MoE, x_BSD: torch.Tensor) -> list[str]:
    """The layer's forward as the ops it issued, in order: all_to_all, wait, shared (a shared
    expert's projection); other ops left out."""
    shared_weights = {tuple(m.weight.shape) for m in (moe.shared_experts.gate_proj, moe.shared_experts.down_proj)}
    others = {tuple(moe.gate.weight.shape)}
    assert not shared_weights & others, "the tiny preset's shapes must tell the router from the shared experts"
    marks = []  # the routed experts' forward as a profiler range named "experts"
    hooks = [moe.experts.register_forward_pre_hook(lambda *_: marks.append(record_function("experts").__enter__())),
             moe.experts.register_forward_hook(lambda *_: marks.pop().__exit__(None, None, None))]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = moe(x_BSD)
    for hook in hooks:
        hook.remove()
    out.sum().backward()  # the split halves keep autograd working
    order = []
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name == ALL_TO_ALL:
            order.append("all_to_all")
        elif event.name in (WAIT, "experts"):
            order.append(event.name.split("::")[-1].replace("_tensor", ""))
        elif event.name == "aten::linear" and tuple(event.input_shapes[1]) in shared_weights:
            order.append("shared")
    return order


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
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = apply_expert_parallel(build_model(get_preset("tiny"), seed=0, attention_backend="eager"), mesh)
    moe = model.model.layers[2].mlp
    assert isinstance(moe, MoE)
    x_BSD = torch.randn(1, 11 + 4 * rank, get_preset("tiny").hidden_size, generator=torch.Generator().manual_seed(rank))
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
    with pytest.raises(ValueError, match="ep_overlap_chunks 2: .* all_to_all dispatcher"):
        parallelize_glm5(build_model(get_preset("tiny"), seed=0), mesh=mesh, ep_dispatcher="all_gather",
                         ep_overlap_chunks=2)
    torch.save({"one": one_chunk, "two": two_chunks}, out_dir / f"runs{rank}.pt")


def _rows_order(order: list[str]) -> list[str]:
    """`order` after the counts' exchange: its all-to-all and the waits it is given at once
    (`wait_tensor` on the functional collective's wrapper, which waits its own tensor too)."""
    assert order[:2] == ["all_to_all", "wait"], order
    first = 1 + next(i for i, op in enumerate(order[1:]) if op != "wait")
    return order[first:]


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    """Both ranks' op orders and runs, one gloo run shared by the tests."""
    out_dir = tmp_path_factory.mktemp("ep_overlap")
    run_gloo(_overlap_worker, 2, out_dir, out_dir, timeout_s=120)
    return out_dir


def test_shared_experts_run_while_the_rows_all_to_alls_are_in_flight(ranks_dir):
    tmp_path = ranks_dir
    for rank in range(2):
        order = _rows_order(json.loads((tmp_path / f"order{rank}.json").read_text())["1"])
        # The dispatch's rows sent, the shared experts' gate and up projections, then the wait;
        # the experts; the outputs sent back, the shared down projection, then the wait.
        assert order == ["all_to_all", "shared", "shared", "wait", "experts",
                         "all_to_all", "shared", "wait"], (rank, order)


def test_two_chunks_overlap_each_others_all_to_alls_and_equal_one_chunk(ranks_dir):
    tmp_path, worst = ranks_dir, 0.0
    for rank in range(2):
        order = _rows_order(json.loads((tmp_path / f"order{rank}.json").read_text())["2"])
        # Counts of both chunks in one exchange (above); both chunks' rows sent before chunk 0's
        # experts, so chunk 1's travel meanwhile; chunk 0's outputs sent back before chunk 1's
        # rows are waited for and travel while chunk 1's experts compute.
        assert order == ["all_to_all", "all_to_all", "shared", "shared", "wait", "experts",
                         "all_to_all", "wait", "experts", "all_to_all", "shared", "wait", "wait"], (rank, order)
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
