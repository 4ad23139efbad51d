"""Expert parallelism hides the all-to-alls behind the shared experts (issue 50's overlap), on CPU.

Two gloo ranks run one GLM-5 MoE layer (tiny, all-to-all dispatcher, ep 2) forward under the
torch profiler, and the order in which ops were issued is read from it: each all-to-all that
carries rows (`_c10d_functional::all_to_all_single`, the dispatch's and the combine's) must
have a shared-expert projection issued between it and its `_c10d_functional::wait_tensor`,
i.e. the shared experts run while the rows are in flight. No timing is read: only the order.
The counts' all-to-all (waited at once: its host sync sizes the rows' exchange) is left out.

Backward is not asserted: torch's all-to-all backward (`all_to_all_single_backward` in
`torch/distributed/_functional_collectives.py`) waits inside its autograd node, so nothing
overlaps it, in any schedule (docs/parallelism.md).
"""

from __future__ import annotations

import json

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from glmtune.distributed.expert_parallel import apply_expert_parallel
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.moe import MoE
from tests.distributed.gloo_helpers import run_gloo

ALL_TO_ALL = "_c10d_functional::all_to_all_single"
WAIT = "_c10d_functional::wait_tensor"


def _issue_order(moe: MoE, x_BSD: torch.Tensor) -> list[str]:
    """The layer's forward as the ops it issued, in order: all_to_all, wait, shared (a shared
    expert's projection); other ops left out."""
    shared_weights = {tuple(m.weight.shape) for m in (moe.shared_experts.gate_proj, moe.shared_experts.down_proj)}
    others = {tuple(moe.gate.weight.shape)}
    assert not shared_weights & others, "the tiny preset's shapes must tell the router from the shared experts"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = moe(x_BSD)
    out.sum().backward()  # the split halves keep autograd working
    order = []
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name == ALL_TO_ALL:
            order.append("all_to_all")
        elif event.name == WAIT:
            order.append("wait")
        elif event.name == "aten::linear" and tuple(event.input_shapes[1]) in shared_weights:
            order.append("shared")
    return order


def _overlap_worker(rank: int, world: int, out_dir) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = apply_expert_parallel(build_model(get_preset("tiny"), seed=0, attention_backend="eager"), mesh)
    moe = model.model.layers[2].mlp
    assert isinstance(moe, MoE)
    x_BSD = torch.randn(1, 11 + 4 * rank, get_preset("tiny").hidden_size, generator=torch.Generator().manual_seed(rank))
    (out_dir / f"order{rank}.json").write_text(json.dumps(_issue_order(moe, x_BSD)))


def test_shared_experts_run_while_the_rows_all_to_alls_are_in_flight(tmp_path):
    run_gloo(_overlap_worker, 2, tmp_path, tmp_path, timeout_s=120)
    for rank in range(2):
        order = json.loads((tmp_path / f"order{rank}.json").read_text())
        # Counts (waited at once), the dispatch's rows, the combine's rows.
        assert order.count("all_to_all") == 3, order
        assert order.count("shared") == 3, order  # gate, up, down projections
        rows = [i for i, op in enumerate(order) if op == "all_to_all"][1:]
        for issued in rows:
            waited = order.index("wait", issued)
            assert "shared" in order[issued:waited], (rank, order)
