"""The whole model's tensors on rank 0 when pipeline stages hold different parts of it.

Under pipeline parallelism each rank's model holds only its stages' parameters (under
the full model's names). Writing an HF export needs every tensor on the writer, global
rank 0, one at a time:

    for key, full in gathered_to_rank0(model.state_dict(), pp_group):   # every rank
        ...  # full is the unsharded tensor on global rank 0, None elsewhere

`pipeline_entries` first agrees on the list of tensors (name, shape, dtype, the pp rank
holding it) over the pp group, in model order. Then, per tensor, the ranks of the
owning stage gather it (FSDP2/EP shards: a collective within that stage), and the
stage's first rank sends it to global rank 0 (point to point). Rank 0 holds one
tensor at a time beyond what its caller keeps.

Small states (LoRA adapters) use `merge_on_rank0` instead: every pp rank's dict of
CPU tensors in one object all-gather over the pp group.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def model_order(key: str) -> tuple[int, int]:
    """Sort key: embedding, decoder layers by index, final norm and head, then MTP layers."""
    if key.startswith("model.embed_tokens."):
        return (0, 0)
    match = _LAYER.match(key)
    if match:
        return (1, int(match.group(1)))
    if key.startswith("mtp."):
        return (3, 0)
    return (2, 0)


def pipeline_entries(state: dict[str, torch.Tensor], pp_group) -> list[tuple[str, torch.Size, torch.dtype, int]]:
    """(name, global shape, dtype, owning pp rank) of every tensor of every stage, in model order."""
    mine = [(key, tuple(t.shape), t.dtype) for key, t in state.items()]
    everyone: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, mine, group=pp_group)
    entries = [(key, torch.Size(shape), dtype, owner) for owner, part in enumerate(everyone)
               for key, shape, dtype in part]
    names = [e[0] for e in entries]
    assert len(set(names)) == len(names), "a tensor held by two pipeline ranks"
    return sorted(entries, key=lambda e: model_order(e[0]))  # stable: a layer's tensors keep their order


@torch.no_grad()
def gathered_to_rank0(state: dict[str, torch.Tensor], pp_group, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, unsharded tensor on global rank 0 / None elsewhere) of every stage's tensors.

    Call on every rank, consuming the whole iterator (each step is collective)."""
    rank = dist.get_rank()
    pp_rank = dist.get_rank(pp_group)
    sender_of = {r: dist.get_global_rank(pp_group, r) for r in range(dist.get_world_size(pp_group))}
    # This rank's pp group holds one rank per stage; the group of global rank 0 holds each stage's first rank.
    first_ranks = rank == 0 or _in_rank0_group(pp_group)
    for key, shape, dtype, owner in pipeline_entries(state, pp_group):
        full = None
        if owner == pp_rank:
            tensor = state[key]
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if rank == 0:
            if owner != pp_rank:
                full = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(full, sender_of[owner])
            yield key, full
        else:
            if owner == pp_rank and first_ranks:
                dist.send(full.contiguous(), 0)
            yield key, None
        del full


def _in_rank0_group(pp_group) -> bool:
    return 0 in dist.get_process_group_ranks(pp_group)


def merge_on_rank0(piece: Any, pp_group, merge) -> Any | None:
    """`merge([every pp rank's piece])` on global rank 0 (small, picklable pieces); None elsewhere."""
    everyone: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(everyone, piece, group=pp_group)
    return merge(everyone) if dist.get_rank() == 0 else None
