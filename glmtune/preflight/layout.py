"""A recipe's parallel layout scaled down to a few processes, and its one-process counterpart.

NVIDIA's GLM-5 topologies run on 256 GPUs (pp 4 x dp_shard 64 with ep 64, or pp 4 x
dp_shard 16 x cp 8). A short run exercises the same kinds of parallelism and the same
checkpoint layout with each axis the recipe uses at a degree of 2: pipeline (the recipe's
schedule, at most two virtual stages per rank, one row per pipeline microbatch), context,
expert (carved out of dp_shard x cp, as always) and HSDP replicas, with FSDP over the
ranks left. The reference is one process with the same global batch, which must give the
same losses step by step:

    replica = scaled_replica(cfg.parallel)             # the axes at 2, 2 data-parallel ranks
    replica = scaled_replica(cfg.parallel, world=8)    # fitted to 8 processes
    glmtune train RECIPE --nproc-per-node {replica.world} {replica.layout} {replica.batch}
    glmtune train RECIPE {ONE_PROCESS} {replica.batch}  # the reference

An axis that does not fit the processes given is left at 1 and named in `not_exercised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmtune.config.schema import ParallelConfig

# A recipe that pins its topology (32 nodes x 8 GPUs) would refuse any other world size.
UNPINNED_TOPOLOGY = ["--parallel.nodes", "null", "--parallel.gpus_per_node", "null",
                     "--parallel.launcher", "torchrun", "--parallel.world_size", "null"]
# The expert all-to-all's settings at ep 1 (each is refused there otherwise).
EP_OFF = ["--parallel.ep_overlap_chunks", "1", "--parallel.ep_keep_exchanges", "none"]
# The same recipe in one process: no parallel degrees, nor the pipeline keys that need pp.
ONE_PROCESS = ["--parallel.pp", "1", "--parallel.cp", "1", "--parallel.ep", "1", "--parallel.dp_replicate", "1",
               "--parallel.pp_schedule", "1F1B", "--parallel.pp_stages_per_rank", "1",
               "--parallel.pp_microbatches", "null", "--parallel.ep_dispatcher", "all_to_all",
               *EP_OFF, "--parallel.pp_ep_overlap", "false"]


@dataclass(frozen=True)
class Replica:
    world: int  # processes the scaled layout uses
    pp: int
    cp: int
    ep: int
    dp: int  # data-parallel ranks: dp_replicate x dp_shard
    layout: list[str]  # the --parallel.* overrides of the scaled run
    batch: list[str]  # the --train.* batch overrides the scaled run and the one-process run share
    not_exercised: list[str] = field(default_factory=list)  # the recipe's axes left at 1, and why

    def describe(self) -> str:
        parts = [f"{name} {degree}" for name, degree in (("pp", self.pp), ("cp", self.cp)) if degree > 1]
        text = " x ".join([*parts, f"dp {self.dp}"]) + (f", ep {self.ep}" if self.ep > 1 else "")
        return f"{self.world} processes: {text}"


def scaled_replica(parallel: ParallelConfig, world: int | None = None, micro_batch_size: int = 2,
                   accumulation: int = 2) -> Replica:
    """The recipe's layout with every axis it uses at 2.

    Args:
        parallel: the recipe's `parallel` section.
        world: processes available; None gives the axes at 2 with 2 data-parallel ranks. With
            too few, context parallelism is dropped first, then pipeline parallelism.
        micro_batch_size: rows per rank per forward (2 under pp: one per pipeline microbatch).
        accumulation: micro batches per rank per step; the global batch is
            `micro_batch_size x dp x accumulation`.
    """
    pp, cp = (2 if parallel.pp > 1 else 1), (2 if parallel.cp > 1 else 1)
    missing = []
    if world is None:
        world = pp * cp * 2
    if pp * cp > world and cp > 1:
        missing.append(f"cp (the recipe's {parallel.cp}) needs {pp * cp} processes, {world} given")
        cp = 1
    if pp > world:
        missing.append(f"pp (the recipe's {parallel.pp}) needs 2 processes, {world} given")
        pp = 1
    dp = world // (pp * cp)
    replicate = 2 if parallel.dp_replicate > 1 and dp >= 4 and dp % 2 == 0 else 1
    ep = 2 if parallel.ep > 1 and dp // replicate * cp % 2 == 0 else 1
    if parallel.dp_replicate > 1 and replicate == 1:
        missing.append(f"dp_replicate (the recipe's {parallel.dp_replicate}) needs 4 data-parallel ranks, "
                       f"{world} processes give {dp}")
    if parallel.ep > 1 and ep == 1:
        missing.append(f"ep (the recipe's {parallel.ep}) needs 2 ranks of dp_shard x cp, {world} processes give "
                       f"{dp * cp}")
    layout = ["--parallel.pp", str(pp), "--parallel.cp", str(cp), "--parallel.ep", str(ep)]
    if parallel.dp_replicate > 1:
        layout += ["--parallel.dp_replicate", str(replicate)]
    if ep == 1:  # the expert all-to-all's own settings need ep > 1
        layout += [*EP_OFF, "--parallel.ep_dispatcher", "all_to_all"]
    if pp == 1 or ep == 1:
        layout += ["--parallel.pp_ep_overlap", "false"]
    if pp > 1:  # the recipe's schedule, two virtual stages per rank at most, one row per microbatch
        stages_per_rank = min(parallel.pp_stages_per_rank, 2)
        if parallel.pp_schedule in ("1F1B", "DualPipeV"):  # at least as many microbatches as stages
            micro_batch_size = max(micro_batch_size, pp * stages_per_rank)
        layout += ["--parallel.pp_stages_per_rank", str(stages_per_rank),
                   "--parallel.pp_microbatches", str(micro_batch_size)]
    batch = ["--train.micro_batch_size", str(micro_batch_size),
             "--train.global_batch_size", str(micro_batch_size * dp * accumulation)]
    return Replica(pp * cp * dp, pp, cp, ep, dp, layout, batch, missing)
