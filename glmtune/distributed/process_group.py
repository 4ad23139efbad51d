"""A process group of this process alone, for what needs one in a one-process run.

FSDP2 carries the mixed precision of fp32 master weights (bf16 compute on fp32 parameters),
so it applies in a one-process run too, and FSDP2 needs a process group.
"""

from __future__ import annotations

import torch.distributed as dist


def one_rank_process_group(device_type: str) -> bool:
    """Join a process group of this process alone when none exists, so FSDP2's mixed
    precision can run in a one-process run; True when one was created (the caller
    destroys it with `torch.distributed.destroy_process_group()`)."""
    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    return True
