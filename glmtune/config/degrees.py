"""The mesh arithmetic of a run: its parallel degrees resolved, checked and multiplied out.

Numbers only, no torch: `glmtune config validate`, the planner and the training run all
ask this module (the runtime meshes are `glmtune.distributed.mesh.ParallelMesh`, whose
docstring draws the layout).

    world_size = pp x dp_replicate x dp_shard x cp x tp        (ranks, outer to inner)

Expert parallelism adds no ranks: `ep` consecutive ranks of the dp_shard x cp ranks of a
replica hold different experts, and each expert's weights are FSDP-sharded over the
`efsdp = dp_shard x cp / ep` ranks that hold the same experts. The one rule of what ep
must divide lives here (`MeshDegrees.layout_errors`), and so does the one rule of when
parameters are FSDP2 shards (`MeshDegrees.fsdp_applies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmtune.config.schema import ParallelConfig

# Degrees the config accepts as a layout but this version cannot run yet.
NOT_BUILT = {"tp": "tensor"}


def raise_config_errors(errors: list[str]) -> None:
    """One ValueError for all `errors`: the message itself, or a count and one per line."""
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} config errors:\n  " + "\n  ".join(errors))


def expert_split_errors(ep: int, num_experts: int) -> list[str]:
    """The one rule of how experts split: ep ranks hold equal shares of the routed experts."""
    return [] if num_experts % ep == 0 else [f"parallel.ep ({ep}) must divide the model's {num_experts} routed experts"]


@dataclass(frozen=True)
class MeshDegrees:
    """The resolved degrees of one run (dp_shard filled in); see the module docstring."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int

    @classmethod
    def resolve(cls, parallel: ParallelConfig, world_size: int) -> MeshDegrees:
        """Fill `dp_shard: -1` from the world size and check that the degrees multiply to it.

        Raises ValueError naming the keys: a degree < 1, or a product other than the
        world size. `layout_errors` checks what ep must divide.
        """
        p = parallel
        errors = [f"parallel.{key} must be >= 1, got {getattr(p, key)}"
                  for key in ("dp_replicate", "tp", "pp", "ep", "cp") if getattr(p, key) < 1]
        if p.dp_shard < 1 and p.dp_shard != -1:
            errors.append(f"parallel.dp_shard must be >= 1 or -1 (fill), got {p.dp_shard}")
        raise_config_errors(errors)
        others = p.dp_replicate * p.cp * p.tp * p.pp
        if p.dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate x cp x tp x pp "
                    f"= {p.dp_replicate} x {p.cp} x {p.tp} x {p.pp} = {others}, so parallel.dp_shard cannot be filled")
            dp_shard = world_size // others
        elif others * p.dp_shard != world_size:
            raise ValueError(
                f"parallel.dp_replicate x dp_shard x cp x tp x pp = {p.dp_replicate} x {p.dp_shard} x {p.cp} x "
                f"{p.tp} x {p.pp} = {others * p.dp_shard}, but the world size is {world_size} "
                "(set parallel.dp_shard: -1 to fill)")
        else:
            dp_shard = p.dp_shard
        return cls(world_size, p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep)

    @property
    def dp(self) -> int:
        """Ranks that see different rows of a batch (cp/tp/pp ranks share rows)."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert weights: the dp_shard x cp ranks of a replica left after EP."""
        return self.dp_shard * self.cp // self.ep

    def layout_errors(self, num_experts: int | None = None) -> list[str]:
        """What ep must divide: dp_shard x cp (the ranks it is carved from) and the routed experts."""
        errors = [] if num_experts is None else expert_split_errors(self.ep, num_experts)
        if (self.dp_shard * self.cp) % self.ep:
            errors.append(
                f"parallel.ep ({self.ep}) must divide parallel.dp_shard x parallel.cp ({self.dp_shard} x {self.cp} = "
                f"{self.dp_shard * self.cp}): expert-parallel ranks are carved from the sharded data-parallel ranks")
        return errors

    def not_built_errors(self) -> list[str]:
        """One message per degree this version cannot run yet (tp > 1)."""
        return [f"parallel.{key} is {getattr(self, key)}, but {kind} parallelism is not built in this version "
                f"yet; set parallel.{key}: 1" for key, kind in NOT_BUILT.items() if getattr(self, key) > 1]

    def fsdp_applies(self) -> bool:
        """Whether parameters are FSDP2 shards: any multi-rank run (one process holds them whole)."""
        return self.world_size > 1

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp}"
            f" x tp {self.tp} x pp {self.pp}; ep {self.ep} (expert FSDP {self.efsdp})"
        )
