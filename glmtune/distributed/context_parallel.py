"""Context parallelism (CP): each row's queries split over a `cp` process group, keys all-gathered.

The scheme is NVIDIA AutoModel's for GLM-5 (not ring attention): every cp rank receives
the same full rows and computes its share of their queries (`SequenceShard`, with their
global positions); per layer the compressed KV (normed 512-dim latent | roped 64-dim
k_rot: 576 values per token) and the indexer keys (128 per token) are all-gathered with
autograd, and each rank runs kv_b over the gathered latent, picks its queries' top-k
exactly against all keys (no cross-shard merge) and attends them. The model side is the
model's (GLM-5's in `glmtune/models/glm5/{model,attention,indexer}.py`); this module only
supplies the collective and installs the shard; it imports no model family.

The interface a model implements (`glmtune/models/common/sequence_shard.py`): the model,
or its core `model.model`, has an attribute `sequence_shard` (None: every query is local)
that its layers read; given a `SequenceShard`, it takes full rows and computes the shard's
queries, gathering keys through `shard.gather`.

`apply_context_parallel(model, group, balance)` sets that `sequence_shard`.
From then on the model takes full rows and returns this rank's queries' outputs; its
loss sum and supervised-token count are this rank's, summed across ranks by the caller
(with the data-parallel ones). Parameter gradients are per rank partial sums, reduced
over the cp ranks like a data-parallel axis (FSDP2 shards over dp_shard x cp).

Legend: B batch, S this rank's queries (T / cp), T tokens of a row, X feature dims, R cp ranks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from glmtune.models.common.sequence_shard import SequenceShard, pieces_of, take_pieces


def _row_order(seq_len: int, size: int, balance: str) -> list[tuple[int, int, int]]:
    """(rank, local offset, length) of every piece of the row, in row order."""
    runs = []
    for rank in range(size):
        local = 0
        for start, length in pieces_of(rank, size, balance, seq_len):
            runs.append((start, rank, local, length))
            local += length
    return [(rank, local, length) for _, rank, local, length in sorted(runs)]


class _GatherSequence(torch.autograd.Function):
    """[B, S, X] local -> [B, T, X] in row order; backward: this rank's slice of the sum over
    ranks of the full-row gradients."""

    @staticmethod
    def forward(ctx, x_BSX, group, balance: str):
        size = dist.get_world_size(group)
        x_BSX = x_BSX.contiguous()
        if dist.get_backend(group) == dist.Backend.NCCL:
            parts_RBSX = x_BSX.new_empty((size, *x_BSX.shape))
            dist.all_gather_into_tensor(parts_RBSX, x_BSX, group=group)
            parts = list(parts_RBSX.unbind(0))
        else:
            parts = [torch.empty_like(x_BSX) for _ in range(size)]
            dist.all_gather(parts, x_BSX, group=group)
        seq_len = x_BSX.shape[1] * size
        ctx.group, ctx.balance, ctx.dtype = group, balance, x_BSX.dtype
        return torch.cat([parts[rank][:, local:local + length]
                          for rank, local, length in _row_order(seq_len, size, balance)], dim=1)

    @staticmethod
    def backward(ctx, grad_BTX):
        group, balance = ctx.group, ctx.balance
        size, seq_len = dist.get_world_size(group), grad_BTX.shape[1]
        # Summed in fp32: in one process these partial sums meet inside one GEMM's fp32
        # accumulator, and the tensors are small (576 or 128 values per token).
        grad_BTX = grad_BTX.float()
        if dist.get_backend(group) == dist.Backend.NCCL:
            stacked_RBSX = torch.stack([take_pieces(grad_BTX, pieces_of(rank, size, balance, seq_len))
                                        for rank in range(size)])
            local_BSX = stacked_RBSX.new_empty(stacked_RBSX.shape[1:])
            dist.reduce_scatter_tensor(local_BSX, stacked_RBSX.flatten(0, 1), group=group)
        else:  # gloo has no reduce_scatter: sum everything, keep this rank's slice
            dist.all_reduce(grad_BTX, group=group)
            local_BSX = take_pieces(grad_BTX, pieces_of(dist.get_rank(group), size, balance, seq_len))
        return local_BSX.to(ctx.dtype), None, None


def gather_sequence(x_BSX: torch.Tensor, group, balance: str) -> torch.Tensor:
    """All-gather this rank's tokens [B, S, X] into the full rows [B, T, X] in row order,
    with autograd (what `SequenceShard.gather` is under context parallelism)."""
    return _GatherSequence.apply(x_BSX, group, balance)


def apply_context_parallel(model: nn.Module, group, balance: str = "head_tail") -> nn.Module:
    """Make `model` compute only this rank's share of the queries of every row, gathering keys
    over `group`.

    Args:
        model: a built model with a `sequence_shard` attribute (module docstring), on itself or
            on its core `model.model` (e.g. a `Glm5ForCausalLM` or its `Glm5Model`); it must not
            be context-parallel already.
        group: the process group of the cp ranks (the `cp` axis of the mesh).
        balance: "head_tail" (equal causal work per rank) or "contiguous" (`parallel.cp_balance`).

    A group of one process leaves the model as it is.
    """
    core = getattr(model, "model", model)
    if core.sequence_shard is not None:
        raise ValueError("apply_context_parallel: the model is already context-parallel")
    size = dist.get_world_size(group)
    shard = SequenceShard(dist.get_rank(group), size, balance,
                          gather=functools.partial(gather_sequence, group=group, balance=balance))
    if size > 1:
        core.sequence_shard = shard
    return model
