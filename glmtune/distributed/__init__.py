"""Distributed machinery: the device mesh, collectives, launchers, and the expert-, context-
and pipeline-parallel transformations.

Below the model families: distributed/ imports io/, kernels/, config/ and models/common/
only, never a model family. It works on interfaces a model implements, all in
models/common/: the routed-experts layer (`token_dispatch`: `dispatcher`, `experts`,
`num_experts`), the sequence shard (`sequence_shard`: a `sequence_shard` attribute), and
the pipeline stage (documented in `pipeline`, fed `microbatch.StageMicrobatch`). A
family's parallelization plan (`models/<family>/parallelize.py`) is where the family
meets this machinery.

  agreement         decisions rank 0 makes for every rank (shared files, refusals, run ids)
  context_parallel  CP: a row's queries split over the cp ranks, keys all-gathered
  expert_parallel   EP: routed experts sharded over the ep ranks, a dispatcher installed
  fsdp_state        FSDP2's unsharded parameters freed after the step that gathered them
  launch            `glmtune train --nproc-per-node`: torchrun on one host
  mesh              the run's device mesh and its process groups
  pipeline          PP: this rank's stages under a torch.distributed.pipelining schedule
  pipeline_plan     PP: layers per stage from per-layer costs, stages per rank (no torch)
  pipeline_state    the whole model's tensors on rank 0 across pipeline stages
  slurm             the sbatch script of a multi-node run
  token_exchange    EP token dispatchers (all-to-all, all-gather reference)
"""
