"""A model evaluated sharded over the ranks of a torchrun job, laid out as training lays it out.

`glmtune eval ... --nproc-per-node N` (or `torchrun ... -m glmtune eval ...`, or under Slurm)
runs the evaluation on every rank. Each model is built on the meta device by its family's
spec, a LoRA candidate's adapter modules put on it (their weights held back), parallelized by
the training code's own plan (`Compute.parallelize`: experts split over `ep` ranks, FSDP2 over
the dense weights and, under EP, over the ranks that hold the same experts; the frozen base in
FP8 with `fp8_base: dequant`), then each rank reads only its own shards of the HF checkpoint
(`Weights.load_sharded`) and its part of the adapter. No rank ever holds the whole model.

The work is split as `glmtune.distributed.lockstep` says: the batches of each round over the
ranks (`answering.run_rows`), every forward taken by all ranks together. Rank 0 writes the
scorecard; each rank's peak memory is reported.

Layout defaults: `ep` 1 and `fp8_base` "none", or, for a run directory candidate, the layout
of that run's own recipe (`parallel.ep`, `model.fp8_base`); the options override it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from glmtune.config import ModelConfig, ParallelConfig, load_run_config
from glmtune.distributed.fsdp_state import release_gathered
from glmtune.distributed.lockstep import Lockstep
from glmtune.distributed.mesh import ParallelMesh
from glmtune.eval.models import ModelSource, checkpoint_dtype
from glmtune.peft.adapter_load import apply_adapter
from glmtune.peft.init import adapter_parameter_names
from glmtune.train.process import init_distributed, resolve_device


@dataclass(frozen=True)
class ShardedLayout:
    """How each model is laid out over the ranks (`--parallel.ep`, `--model.fp8_base`)."""

    ep: int | None = None  # None: the candidate run's parallel.ep, else 1
    fp8_base: str | None = None  # None: the candidate run's model.fp8_base, else "none"

    def resolved(self, candidate: ModelSource) -> "ShardedLayout":
        ep, fp8 = 1, "none"
        if candidate.kind == "run":
            cfg = load_run_config(candidate.source / "config.yaml")
            ep, fp8 = cfg.parallel.ep, cfg.model.fp8_base
        return ShardedLayout(self.ep if self.ep is not None else ep,
                             self.fp8_base if self.fp8_base is not None else fp8)


def join(device_choice: str) -> tuple[Lockstep, torch.device, bool]:
    """This rank's lockstep and device, joining the process group torchrun describes, and whether this
    call joined it (a caller that had joined it already keeps it: `Placement.close`)."""
    # The rank's own GPU before the group is joined (no CUDA context of every rank on GPU 0).
    device = resolve_device(device_choice, int(os.environ.get("LOCAL_RANK", "0")))
    info = init_distributed(device)
    if info.world_size <= 1:
        raise ValueError("a sharded evaluation runs under torchrun with 2 or more processes "
                         "(glmtune eval ... --nproc-per-node N)")
    return Lockstep(device), device, info.joined


def load_sharded_model(model: ModelSource, layout: ShardedLayout, lockstep: Lockstep, device: torch.device,
                       dtype: torch.dtype | None) -> nn.Module:
    """`model` built on meta, its adapter applied, parallelized and loaded: this rank's shards only."""
    assert not model.merged, "a merged candidate is refused before anything loads (evaluate.check_sharded)"
    spec = model.spec
    if layout.fp8_base == "triton" and device.type != "cuda":
        raise ValueError(f"model.fp8_base: triton (--model.fp8_base, or the candidate run's recipe) runs Triton "
                         f"kernels on a CUDA GPU, and this rank runs on {device.type}: pass --model.fp8_base dequant")
    model_cfg = ModelConfig(name_or_path=str(model.weights_dir), fp8_base=layout.fp8_base, family=model.family)
    net, _ = spec.weights.build_from_config(model_cfg, dtype or checkpoint_dtype(model.weights_dir), "meta")
    applied = apply_adapter(net, model.adapter_dir) if model.adapter_dir is not None else None
    parallel = ParallelConfig(ep=layout.ep)
    mesh = ParallelMesh.from_config(parallel, world_size=lockstep.world, device_type=device.type,
                                    num_experts=spec.family.dims(spec.architecture.args_of(net), str(model.weights_dir)).num_experts)
    spec.compute.parallelize(net, mesh, parallel)
    spec.weights.load_sharded(net, model.weights_dir, device, not_in_checkpoint=adapter_parameter_names(net))
    if applied is not None:
        applied.load_into(net)
    net.eval()
    with torch.no_grad():  # FSDP2's lazy initialization (which unit is the root) in a real forward of the family's
        spec.compute.last_token_logits(net, torch.zeros(1, 1, dtype=torch.long, device=device))
    release_gathered(net)  # the root keeps its weights gathered after a forward
    return net
