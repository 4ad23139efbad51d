"""This process in a run: its place in the process group, its device, and the recipe checked
against both (step 1 of `glmtune train`, `glmtune/train/run.py`).

`check_recipe` is every refusal that needs no model weights: the layout against the world
size and the model's experts and layers (its family's `model_dims`), the config's ranges, and
what this torch build cannot run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glmtune.config import JobConfig, validate_config
from glmtune.config.degrees import MeshDegrees, raise_config_errors
from glmtune.config.validate import device_errors
from glmtune.distributed.pipeline_plan import V_SCHEDULES
from glmtune.models.registry import model_dims


@dataclass
class DistributedInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # this call created the process group (the run destroys it when it ends)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistributedInfo:
    """Join the process group when launched by torchrun/Slurm (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedInfo()
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), joined)


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device: cuda requested but no CUDA device is available")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def check_recipe(cfg: JobConfig, world_size: int, device: torch.device) -> MeshDegrees:
    """The mesh degrees of `cfg` on `world_size` ranks on `device`, or a ValueError naming what cannot run."""
    dims = model_dims(cfg.model)
    degrees = validate_config(cfg, dims.num_experts, dims.num_layers, world_size=world_size,
                              model_refusals=dims.refusals)
    raise_config_errors(device_errors(cfg, device.type))
    _check_torch_supports(cfg)
    return degrees


# The V-shaped schedules train exactly on torch 2.13 (tests/distributed/test_pipeline_train.py);
# on torch 2.11 ZBVZeroBubble failed in its stage initialisation (gloo, 2 ranks, H200 image).
V_SCHEDULES_FROM = (2, 13)


def _check_torch_supports(cfg: JobConfig) -> None:
    p = cfg.parallel
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES and version < V_SCHEDULES_FROM:
        raise ValueError(f"parallel.pp_schedule {p.pp_schedule} needs torch >= 2.13 here (this is torch "
                         f"{torch.__version__}: on 2.11 its stage initialisation fails); use Interleaved1F1B or "
                         "InterleavedZeroBubble, or upgrade torch")
