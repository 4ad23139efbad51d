"""The device mesh: degrees and their refusals, rank arithmetic, and real gloo meshes in 1, 2 and 4 processes."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from glmtune.config import ParallelConfig
from glmtune.config.degrees import MeshDegrees
from glmtune.distributed.mesh import ParallelMesh
from tests.distributed.gloo_helpers import PRELOAD, start_forkserver_ranks

NUM_EXPERTS = 8  # the tiny preset's routed experts


def degrees(world_size: int, **parallel) -> MeshDegrees:
    return MeshDegrees.resolve(ParallelConfig(**parallel), world_size)


def test_the_docstring_layout_rank_by_rank():
    """8 ranks = dp_replicate 2 x dp_shard 4 with ep 2: every axis's index of every rank, as drawn."""
    table = {
        "dp_replicate": [0, 0, 0, 0, 1, 1, 1, 1],
        "dp_shard": [0, 1, 2, 3, 0, 1, 2, 3],
        "efsdp": [0, 0, 1, 1, 0, 0, 1, 1],
        "ep": [0, 1, 0, 1, 0, 1, 0, 1],
        "dp": list(range(8)),
        "loss": list(range(8)),
    }
    d = degrees(8, dp_replicate=2, ep=2)
    meshes = [ParallelMesh(d, rank=r, num_experts=NUM_EXPERTS) for r in range(8)]
    for axis, expected in table.items():
        assert [m.rank(axis) for m in meshes] == expected, axis
    sizes = {a: meshes[0].size(a) for a in ("dp_replicate", "dp_shard", "efsdp", "ep", "dp", "loss", "pp", "cp", "tp")}
    assert sizes == {"dp_replicate": 2, "dp_shard": 4, "efsdp": 2, "ep": 2, "dp": 8, "loss": 8, "pp": 1, "cp": 1,
                     "tp": 1}
    assert (meshes[5].dp_size, meshes[5].dp_rank, meshes[5].ep_size, meshes[5].ep_rank) == (8, 5, 2, 1)
    assert meshes[0].describe() == ("world 8 = dp_replicate 2 x dp_shard 4 x cp 1 x tp 1 x pp 1; ep 2 "
                                    "(expert FSDP 2)")


def test_dp_shard_fills_and_the_product_must_be_the_world_size():
    assert degrees(8, dp_replicate=2).dp_shard == 4
    assert degrees(8, dp_shard=8).dp_shard == 8
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate x dp_shard x cp x tp x pp = 2 x 2 x 1 x 1 x 1 = 4, "
                                         r"but the world size is 8 \(set parallel.dp_shard: -1 to fill\)$"):
        degrees(8, dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"^world size 6 is not divisible by parallel.dp_replicate x cp x tp x pp = "
                                         r"4 x 1 x 1 x 1 = 4, so parallel.dp_shard cannot be filled$"):
        degrees(6, dp_replicate=4)
    with pytest.raises(ValueError) as exc:
        degrees(4, ep=0, dp_shard=-2)
    assert str(exc.value).splitlines() == ["2 config errors:", "  parallel.ep must be >= 1, got 0",
                                           "  parallel.dp_shard must be >= 1 or -1 (fill), got -2"]


def test_ep_must_divide_dp_shard_times_cp_and_the_experts():
    with pytest.raises(ValueError, match=r"^parallel.ep \(4\) must divide parallel.dp_shard x parallel.cp \(2 x 1 = 2\)"):
        ParallelMesh(degrees(4, dp_replicate=2, ep=4), rank=0)
    with pytest.raises(ValueError, match=r"^parallel.ep \(3\) must divide the model's 8 routed experts$"):
        ParallelMesh(degrees(3, ep=3), rank=0, num_experts=NUM_EXPERTS)
    assert ParallelMesh(degrees(3, ep=3), rank=2).rank("ep") == 2  # no model given: experts unchecked


def test_tensor_parallelism_is_refused_by_name():
    layout = degrees(4, tp=2)  # a valid layout ...
    with pytest.raises(ValueError) as exc:  # ... that this version cannot build
        ParallelMesh(layout, rank=0)
    assert str(exc.value) == "parallel.tp is 2, but tensor parallelism is not built in this version yet; " \
                             "set parallel.tp: 1"


def test_the_pipeline_and_context_layout_rank_by_rank():
    """8 ranks = pp 2 x dp_shard 2 x cp 2 with ep 2 (the docstring's second table)."""
    table = {
        "pp": [0, 0, 0, 0, 1, 1, 1, 1],
        "dp": [0, 0, 1, 1, 0, 0, 1, 1],
        "cp": [0, 1, 0, 1, 0, 1, 0, 1],
        "dp_shard_cp": [0, 1, 2, 3, 0, 1, 2, 3],
        "ep": [0, 1, 0, 1, 0, 1, 0, 1],
        "efsdp": [0, 0, 1, 1, 0, 0, 1, 1],
        "loss": [0, 1, 2, 3, 0, 1, 2, 3],
    }
    d = degrees(8, pp=2, cp=2, ep=2)
    assert (d.dp_shard, d.efsdp) == (2, 2)
    meshes = [ParallelMesh(d, rank=r, num_experts=NUM_EXPERTS) for r in range(8)]
    for axis, expected in table.items():
        assert [m.rank(axis) for m in meshes] == expected, axis
    assert meshes[0].dense_axis == "dp_shard_cp" and ParallelMesh(degrees(2), rank=0).dense_axis == "dp_shard"


def test_unknown_axis_and_no_process_group():
    mesh = ParallelMesh(degrees(2), rank=1)
    with pytest.raises(ValueError, match="unknown mesh axis 'fsdp'; axes: pp, dp_replicate, dp_shard"):
        mesh.size("fsdp")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        mesh.get("dp_shard")


# Layouts per world size, each checked in one set of spawned gloo processes.
LAYOUTS = {
    1: [{}],
    2: [{}, {"ep": 2}],
    4: [{"dp_replicate": 2}, {"ep": 2}, {"ep": 4}, {"dp_replicate": 2, "ep": 2}, {"pp": 2}, {"cp": 2},
        {"pp": 2, "cp": 2, "ep": 2}, {"cp": 2, "ep": 4}],
}


def _members(mesh: ParallelMesh, axis: str) -> list[int]:
    """The global ranks whose indices on every other axis equal this rank's: `axis`'s group."""
    others = {"dp_replicate": ("pp", "dp_shard_cp"), "dp_shard": ("pp", "dp_replicate", "cp"),
              "dp_shard_cp": ("pp", "dp_replicate"), "ep": ("pp", "dp_replicate", "efsdp"),
              "efsdp": ("pp", "dp_replicate", "ep"), "loss": ("pp",), "pp": ("loss",), "cp": ("pp", "dp"),
              "dp": ("pp", "cp")}[axis]
    peers = [ParallelMesh(mesh.degrees, rank=r) for r in range(mesh.world_size)]
    return [p.global_rank for p in peers if all(p.rank(a) == mesh.rank(a) for a in others)]


def _check_layouts(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)  # the processes share the machine's cores
    # A rank stuck in a collective (a wrong group) fails after the timeout instead of hanging the suite.
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for parallel in LAYOUTS[world_size]:
            mesh = ParallelMesh.from_config(ParallelConfig(**parallel), world_size=world_size,
                                            num_experts=NUM_EXPERTS)
            d = mesh.degrees
            axes = [mesh.dense_axis, "ep", "efsdp", "loss", "dp"] + (["dp_replicate"] if d.dp_replicate > 1 else []) \
                + (["pp"] if d.pp > 1 else []) + (["cp"] if d.cp > 1 else [])
            for axis in axes:
                group = mesh.group(axis)
                members = _members(mesh, axis)
                assert dist.get_process_group_ranks(group) == members, (parallel, axis)
                assert (mesh.get(axis).size(), mesh.get(axis).get_local_rank()) == (mesh.size(axis), mesh.rank(axis))
                total = torch.tensor([rank])
                dist.all_reduce(total, group=group)  # the group really connects its members
                assert total.item() == sum(members), (parallel, axis)

            dense = mesh.fsdp_mesh()
            inner = mesh.dense_axis
            assert dense.mesh_dim_names == (("dp_replicate", inner) if d.dp_replicate > 1 else (inner,))
            experts = mesh.expert_fsdp_mesh()
            if d.ep == 1:
                assert experts is dense
            else:
                assert experts.mesh_dim_names == (("dp_replicate", "efsdp") if d.dp_replicate > 1 else ("efsdp",))
                # FSDP2 shards EP-placed experts on this mesh only if both share a root mesh.
                module = torch.nn.Module()
                full = torch.arange(NUM_EXPERTS * 2 * 4, dtype=torch.float32).view(NUM_EXPERTS, 2, 4)
                module.w = torch.nn.Parameter(distribute_tensor(full, mesh.get("ep"), [Shard(0)]))
                fully_shard(module, mesh=experts, shard_placement_fn=lambda p: Shard(1))
                assert isinstance(module.w, DTensor) and torch.equal(module.w.full_tensor(), full)
                local_experts = NUM_EXPERTS // d.ep
                assert module.w.to_local().shape == (local_experts, 2 // d.efsdp, 4)

        cpu = mesh.cpu_group()
        assert cpu is mesh.cpu_group() and cpu is not dist.group.WORLD
        assert dist.get_backend(cpu) == "gloo" and dist.get_process_group_ranks(cpu) == list(range(world_size))
        total = torch.ones(1)
        dist.all_reduce(total, group=cpu)
        assert total.item() == world_size
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_meshes_on_gloo(world_size, tmp_path):
    # Fresh processes forked from a server that has imported this module (torch, DTensor,
    # FSDP) once: each spawned process would spend ~10 s importing them again.
    context = start_forkserver_ranks(_check_layouts, (world_size, str(tmp_path / "store")), world_size,
                                     preload=[*PRELOAD, __name__])
    while not context.join():
        pass
