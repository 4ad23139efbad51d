"""The device mesh of a run: degrees, their validation, and the torch DeviceMeshes built from them.

`MeshDegrees` (glmtune/config/degrees.py) is the resolved layout, numbers only: `glmtune
config validate`, the planner and the start of `glmtune train` check it against the world
size and the model. `ParallelMesh` is the runtime object the rest of the code asks for meshes,
process groups, ranks and sizes; it builds each torch `DeviceMesh` on first use.

    world_size = pp x dp_replicate x dp_shard x cp x tp        (ranks, outer to inner)

Pipeline stages are the outermost split: each stage's ranks are one contiguous block
holding the same layers, and everything below happens within a stage. Context-parallel
ranks (cp) read the same rows and split each row's queries; they are FSDP shards like
dp_shard ranks, so dense parameters are sharded over the `dp_shard x cp` ranks of a
replica (`dp_shard_cp`; `dp_shard` itself when cp is 1).

Expert parallelism adds no ranks: within one replica, the dp_shard x cp ranks are
split into `ep` consecutive ranks that hold different experts, and the expert
weights are FSDP-sharded over the `efsdp = dp_shard x cp / ep` ranks that hold the
same experts. Example: 8 ranks, dp_replicate 2 x dp_shard 4, ep 2:
    global rank    0  1  2  3 | 4  5  6  7
    dp_replicate   0  0  0  0 | 1  1  1  1   HSDP replicas        {0,4} {1,5} {2,6} {3,7}
    dp_shard       0  1  2  3 | 0  1  2  3   dense FSDP shards    {0,1,2,3} {4,5,6,7}
    efsdp          0  0  1  1 | 0  0  1  1   expert FSDP shards   {0,2} {1,3} {4,6} {5,7}
    ep             0  1  0  1 | 0  1  0  1   expert parallel      {0,1} {2,3} {4,5} {6,7}
    dp, loss       0  1  2  3   4  5  6  7   different rows; token counts summed over all

And 8 ranks = pp 2 x dp_shard 2 x cp 2, ep 2 (the shape of NVIDIA's GLM-5 recipes):
    global rank    0  1  2  3 | 4  5  6  7
    pp             0  0  0  0 | 1  1  1  1   pipeline             {0,4} {1,5} {2,6} {3,7}
    dp (rows)      0  0  1  1 | 0  0  1  1   data parallel        {0,2} {1,3} {4,6} {5,7}
    cp             0  1  0  1 | 0  1  0  1   context parallel     {0,1} {2,3} {4,5} {6,7}
    dp_shard_cp    0  1  2  3 | 0  1  2  3   dense FSDP shards    {0,1,2,3} {4,5,6,7}
    ep             0  1  0  1 | 0  1  0  1   expert parallel      {0,1} {2,3} {4,5} {6,7}
    efsdp          0  0  1  1 | 0  0  1  1   expert FSDP shards   {0,2} {1,3} {4,6} {5,7}
    loss           0  1  2  3 | 0  1  2  3   one stage's loss sums {0,1,2,3} {4,5,6,7}

`ep` is the innermost split so that an all-to-all stays within neighbouring ranks
(one host's NVLink when ep <= GPUs per host).

API (every `get`/`group`/`*_mesh` call builds groups on first use, which is a
collective: make the same calls in the same order on every rank):
    mesh = ParallelMesh(degrees, device_type="cuda")   # rank from torch.distributed
    mesh.size("ep"), mesh.rank("efsdp")                  # any axis in AXES; pure arithmetic
    mesh.dp_size, mesh.dp_rank, mesh.ep_size, mesh.ep_rank
    mesh.fsdp_mesh()         # dense FSDP2: 1-D (dp_shard[_cp]) or 2-D (dp_replicate, dp_shard[_cp]) = HSDP
    mesh.expert_fsdp_mesh()  # experts' FSDP2: 1-D (efsdp) or 2-D (dp_replicate, efsdp); the dense one at ep 1
    mesh.get("ep")           # a 1-D DeviceMesh of one axis (ep shares its root with the expert FSDP mesh,
    mesh.group("loss")       #   as FSDP2 requires for DTensor experts); its ProcessGroup
    mesh.cpu_group()         # a dedicated gloo group, e.g. for DCP async_save under NCCL

Tensor parallelism (tp > 1) is validated as a layout but not built: `MeshDegrees.
not_built_errors` names it, and `ParallelMesh` refuses it. torch is imported only
when a mesh is built, so validating a recipe stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmtune.config.degrees import MeshDegrees, raise_config_errors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from glmtune.config.schema import ParallelConfig

# Axes a ParallelMesh answers `size`/`rank` for; "dp" (ranks that read different rows)
# and "loss" (ranks whose token counts add up) are flattened views, not extra ranks.
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp_shard_cp", "ep", "efsdp", "dp", "loss")


class ParallelMesh:
    """Sizes, ranks, DeviceMeshes and process groups of a run's layout (module docstring).

    Args:
        degrees: the resolved degrees (`MeshDegrees.resolve`, or the config's `validate_config`).
        rank: this process's global rank; None = torch.distributed's (0 when not initialized).
        device_type: "cuda" or "cpu": the device type of every DeviceMesh (NCCL or gloo groups).
        num_experts: when given, the routed experts must divide by ep.

    Raises:
        ValueError: an ep that does not divide dp_shard x cp (or the experts), or a
            degree this version cannot run (tp > 1); the message names the key.
    """

    def __init__(self, degrees: MeshDegrees, *, rank: int | None = None, device_type: str = "cpu",
                 num_experts: int | None = None) -> None:
        raise_config_errors(degrees.layout_errors(num_experts) + degrees.not_built_errors())
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        assert 0 <= rank < degrees.world_size, (rank, degrees)
        self.degrees = degrees
        self.global_rank = rank
        self.device_type = device_type
        self._roots: dict[str, DeviceMesh] = {}
        self._cpu_group: ProcessGroup | None = None
        self._second_pp: ProcessGroup | None = None

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, world_size: int, num_experts: int | None = None,
                    rank: int | None = None, device_type: str = "cpu") -> ParallelMesh:
        """Resolve `parallel` against `world_size` and build the mesh object (no groups yet)."""
        return cls(MeshDegrees.resolve(parallel, world_size), rank=rank, device_type=device_type,
                   num_experts=num_experts)

    # Sizes and ranks: arithmetic on the global rank (tp = 1 in this version).

    def size(self, axis: str) -> int:
        d = self.degrees
        sizes = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp,
                 "dp_shard_cp": d.dp_shard * d.cp, "ep": d.ep, "efsdp": d.efsdp, "dp": d.dp, "loss": d.dp * d.cp}
        return sizes[_check_axis(axis)]

    def rank(self, axis: str) -> int:
        """This process's index along `axis` (its position in that axis's group)."""
        d = self.degrees
        stage_size = d.world_size // d.pp
        within = self.global_rank % stage_size  # (dp_replicate, dp_shard, cp, tp) of this stage
        cp_index = (within // d.tp) % d.cp
        shard = (within // (d.tp * d.cp)) % d.dp_shard
        replica = within // (d.tp * d.cp * d.dp_shard)
        sharded = shard * d.cp + cp_index  # index within the replica's dp_shard x cp ranks
        dp = replica * d.dp_shard + shard
        ranks = {"pp": self.global_rank // stage_size, "cp": cp_index, "tp": self.global_rank % d.tp,
                 "dp_replicate": replica, "dp_shard": shard, "dp_shard_cp": sharded, "ep": sharded % d.ep,
                 "efsdp": sharded // d.ep, "dp": dp, "loss": dp * d.cp + cp_index}
        return ranks[_check_axis(axis)]

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")

    @property
    def ep_size(self) -> int:
        return self.size("ep")

    @property
    def ep_rank(self) -> int:
        return self.rank("ep")

    # DeviceMeshes, built on first use. Four roots, each init_device_mesh over all ranks, each
    # with the pp axis outermost when there is one: data (pp, dp, cp), dense (dp_replicate?,
    # dp_shard[_cp]), experts (dp_replicate?, efsdp, ep), loss (one flat axis per stage). A
    # size-1 dp_replicate or cp is left out rather than built as world_size groups of one.

    _ROOTS = ("data", "dense", "experts", "loss")

    def get(self, axis: str) -> DeviceMesh:
        """The 1-D DeviceMesh of `axis`: pp, dp, cp (each needs > 1, dp excepted), dp_replicate
        (needs > 1), the dense FSDP axis (dp_shard, or dp_shard_cp under cp), ep, efsdp, loss."""
        for root in self._ROOTS:
            if axis in self._root_axes(root):
                return self._root(root)[axis]
        buildable = sorted({a for root in self._ROOTS for a in self._root_axes(root)})
        raise ValueError(f"no DeviceMesh for axis {axis!r} in this layout ({self.degrees.describe()}); "
                         f"built axes: {', '.join(buildable)}")

    def group(self, axis: str) -> ProcessGroup:
        """The process group of `axis` (see `get`)."""
        return self.get(axis).get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for dense parameters: (dp_shard,), or (dp_replicate, dp_shard) for HSDP."""
        if "fsdp" not in self._roots:  # one object: sub-meshes are new objects on every slicing
            names = tuple(a for a in self._root_axes("dense") if a != "pp")
            root = self._root("dense")
            self._roots["fsdp"] = root if names == root.mesh_dim_names else root[names]
        return self._roots["fsdp"]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for routed-expert parameters: (efsdp,) or (dp_replicate, efsdp) under EP.

        It shares its root with `get("ep")`, so experts placed on the ep mesh can be
        sharded on it. With ep 1 the experts are plain parameters: the dense mesh.
        """
        if self.degrees.ep == 1:
            return self.fsdp_mesh()
        root = self._root("experts")
        return root["efsdp"] if self.degrees.dp_replicate == 1 else root["dp_replicate", "efsdp"]

    @property
    def dense_axis(self) -> str:
        """The axis dense parameters are sharded over within a replica: dp_shard, or dp_shard_cp under cp."""
        return "dp_shard_cp" if self.degrees.cp > 1 else "dp_shard"

    def second_pp_group(self) -> ProcessGroup:
        """A second process group over this rank's pipeline (the pp axis), created once (collective:
        every rank creates every pipeline's group, in the same order). Messages the pipeline
        schedule does not move travel on it without interleaving with the schedule's own."""
        if self._second_pp is None:
            import torch.distributed as dist

            self._check_world()
            stage_size = self.world_size // self.degrees.pp
            for first in range(stage_size):
                ranks = [first + s * stage_size for s in range(self.degrees.pp)]
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    self._second_pp = group
        return self._second_pp

    def cpu_group(self) -> ProcessGroup:
        """A gloo group over all ranks, created once (collective on first call).

        DCP's async_save gathers its plan on a CPU-capable group from a background
        thread; a dedicated group also keeps those collectives from interleaving with
        the training step's on the default group (NCCL or gloo).
        """
        if self._cpu_group is None:
            import torch.distributed as dist

            self._check_world()
            self._cpu_group = dist.new_group(backend="gloo")
        return self._cpu_group

    def describe(self) -> str:
        return self.degrees.describe()

    def _root_axes(self, root: str) -> tuple[str, ...]:
        d = self.degrees
        stage = ("pp",) if d.pp > 1 else ()
        replicate = ("dp_replicate",) if d.dp_replicate > 1 else ()
        return {"data": (*stage, "dp", *(("cp",) if d.cp > 1 else ())),
                "dense": (*stage, *replicate, self.dense_axis),
                "experts": (*stage, *replicate, "efsdp", "ep"),
                "loss": (*stage, "loss")}[root]

    def _root(self, root: str) -> DeviceMesh:
        if root not in self._roots:
            from torch.distributed.device_mesh import init_device_mesh

            self._check_world()
            names = self._root_axes(root)
            self._roots[root] = init_device_mesh(self.device_type, tuple(self.size(a) for a in names),
                                                 mesh_dim_names=names)
        return self._roots[root]

    def _check_world(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized: start the processes with torchrun "
                               "(glmtune train ... --nproc-per-node N) before building a mesh")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.global_rank:
            raise RuntimeError(f"the mesh is for rank {self.global_rank} of {self.world_size}, but this process "
                               f"is rank {dist.get_rank()} of {dist.get_world_size()}")


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; axes: {', '.join(AXES)}")
    return axis
