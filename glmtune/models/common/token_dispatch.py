"""Token dispatch for mixture-of-experts layers: the `TokenDispatcher` interface, the
one-device `LocalTokenDispatcher`, and the row permutations both it and the expert-parallel
dispatchers (`glmtune/distributed/token_exchange.py`) build on. Model-agnostic: nothing
here knows a model family.

A dispatcher moves routed tokens to the experts that compute them and their outputs back:
`dispatch` returns the rows this rank's experts compute, grouped by local expert, and
`combine` sums each token's weighted expert outputs. The model calls only those two (each
split in a `*_start` and a `*_finish` half, so it can compute what needs no routed row while
the rows travel), so expert parallelism replaces the dispatcher without touching the model.

The routed-experts layer contract (what `glmtune/distributed/expert_parallel.py` relies on
to find and transform a model's MoE layers, whatever the family; `expert_layers` finds them):

    layer.dispatcher    a `TokenDispatcher`, read at every forward (a `LocalTokenDispatcher`
                        until expert parallelism replaces it)
    layer.experts       the routed experts: an `nn.Module` whose own parameters are all
                        stacked over the experts, [E, ...] (LoRA adapters included), and
                        whose forward takes the dispatched rows and the rows per expert
    layer.num_experts   E, the number of routed experts of the layer

Legend: T tokens, D model dim, E experts, L experts computed on this rank (E without
expert parallelism), K experts per token, N = T*K routed (token, expert) pairs, R rows
this rank's experts compute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from glmtune.kernels import moe_combine


class _PermuteRows(torch.autograd.Function):
    """rows[n] = x[index[n]] for a permutation `index`; the gradient goes back through its
    inverse as another gather (autograd's default for indexing is a scatter-add into zeros)."""

    @staticmethod
    def forward(ctx, x_ND, index_N, inverse_N):
        ctx.save_for_backward(inverse_N)
        return x_ND.index_select(0, index_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse_N,) = ctx.saved_tensors
        return grad_ND.index_select(0, inverse_N), None, None


class _RepeatRows(torch.autograd.Function):
    """rows[n] = x[index[n] // K] where `index` is a permutation of the T*K (token, k) pairs:
    each token copied once per chosen expert. Backward gathers each token's K gradient rows
    through the inverse permutation and sums them in (at least) fp32: no atomics, deterministic."""

    @staticmethod
    def forward(ctx, x_TD, index_N, inverse_N, top_k, fused):
        ctx.save_for_backward(inverse_N)
        ctx.top_k, ctx.fused = top_k, fused
        return x_TD.index_select(0, index_N // top_k)

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse_N,) = ctx.saved_tensors
        if ctx.fused:
            return moe_combine.moe_sum_pairs(grad_ND, inverse_N, ctx.top_k), None, None, None, None
        per_pair = grad_ND.index_select(0, inverse_N).view(-1, ctx.top_k, grad_ND.shape[-1])
        accumulate = torch.promote_types(grad_ND.dtype, torch.float32)
        return per_pair.to(accumulate).sum(dim=1).to(grad_ND.dtype), None, None, None, None


def permute_rows(x_ND: torch.Tensor, index_N: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation `index` whose inverse is `inverse`; backward is a gather too."""
    return _PermuteRows.apply(x_ND, index_N, inverse_N)


def sort_permutation(keys_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of `keys`: (sorted keys, order: sorted position -> index, inverse: index -> position)."""
    sorted_N, order_N = torch.sort(keys_N, stable=True)
    inverse_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    return sorted_N, order_N, inverse_N


def count_per_expert(expert_ids_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert [E] (int64)."""
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync on GPU).
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_ids_N.device)
    return counts_E.scatter_add_(0, expert_ids_N, torch.ones_like(expert_ids_N))


@dataclass
class DispatchState:
    """What `combine` needs to undo `dispatch`; each dispatcher extends it."""

    # This rank's routed (token, expert) pairs per expert, over all E experts (int64): what
    # the layer records as its load (GLM-5's `MoE.tokens_per_expert`); global load comes
    # from all-reducing it.
    tokens_per_expert_E: torch.Tensor


@dataclass
class LocalDispatchState(DispatchState):
    order_N: torch.Tensor  # position in the sorted list -> flat (token, k) pair index
    inverse_N: torch.Tensor  # flat (token, k) pair index -> position in the sorted list
    weights_TK: torch.Tensor  # routing weight of each (token, k) pair (fp32)


class TokenDispatcher(ABC):
    """Moves routed tokens to the experts that compute them and their outputs back.

    The model calls only `dispatch` and `combine`; which experts live on this rank, and
    how tokens travel between ranks, is the dispatcher's business (expert parallelism
    installs its own, see `glmtune/distributed/expert_parallel.py`).

    `overlap_chunks`: how many chunks of consecutive tokens a layer dispatches apart
    (`dispatch_start_chunks`), so one chunk's trips overlap another chunk's experts; 1 = the
    whole layer at once. Per-row results are unchanged, sums over rows (the experts' weight
    gradients) are taken per chunk, so losses move within rounding.
    """

    overlap_chunks: int = 1

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Returns the rows this rank's L experts compute, grouped by local expert [R, D]; rows
        per local expert [L] (int64, for the grouped GEMM); and the state `combine` needs,
        which carries this rank's routing counts over all E experts."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, state: DispatchState, out_dtype: torch.dtype) -> torch.Tensor:
        """Returns [T, D] in `out_dtype`: the sum of each token's experts' outputs weighted by
        its routing weights, in fp32, differentiable in the weights (the router's gradient)."""

    # The two trips in two halves, so a layer can compute what needs no routed row (GLM-5's
    # shared experts) while a trip is in flight: `dispatch_start` returns once the rows are
    # sent, `dispatch_finish` waits for them; likewise `combine_start` / `combine_finish`.
    # `dispatch` = finish(start(...)) and `combine` = finish(start(...)) compute the same thing.
    # These defaults run the whole trip in `*_start`: nothing is in flight between the halves.

    def dispatch_start(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> object:
        """Begins `dispatch`; what it returns goes to `dispatch_finish` and nowhere else."""
        return self.dispatch(x_TD, topk_idx_TK, topk_w_TK, num_experts)

    def dispatch_start_chunks(
        self, chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_experts: int
    ) -> list[object]:
        """`dispatch_start` of each chunk of a layer's tokens ((x, top-k ids, top-k weights) of
        consecutive tokens), all started before any finishes; each result goes to `dispatch_finish`."""
        return [self.dispatch_start(x_TD, idx_TK, w_TK, num_experts) for x_TD, idx_TK, w_TK in chunks]

    def dispatch_finish(self, in_flight: object) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Completes `dispatch_start`: `dispatch`'s result."""
        return in_flight  # type: ignore[return-value]

    def combine_start(self, y_RD: torch.Tensor, state: DispatchState) -> object:
        """Begins `combine`; what it returns goes to `combine_finish` and nowhere else."""
        return y_RD

    def combine_finish(self, in_flight: object, state: DispatchState, out_dtype: torch.dtype) -> torch.Tensor:
        """Completes `combine_start`: `combine`'s result."""
        return self.combine(in_flight, state, out_dtype)  # type: ignore[arg-type]


DISPATCH_BACKENDS = ("auto", "torch", "triton")


class LocalTokenDispatcher(TokenDispatcher):
    """Sorts (token, expert) pairs by expert on one device; the single-rank dispatcher.

    Token movement in both directions, forward and backward, is a row gather through the
    sort permutation or its inverse. Backends: "torch" (the reference, compiled with the
    layer) or "triton" (`glmtune/kernels/moe_combine.py`: the combine and the dispatch's
    backward as one program per token); "auto" is triton on CUDA when installed.
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in DISPATCH_BACKENDS:
            raise ValueError(f"moe dispatch backend {backend!r} unknown; choose from {DISPATCH_BACKENDS}")
        self.backend = backend

    def _fused(self, x: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        usable = moe_combine.available(x.device)
        if self.backend == "triton" and not usable:
            raise ValueError("moe dispatch backend 'triton' needs triton and a CUDA device")
        return usable and (self.backend == "triton" or x.is_cuda)

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchState]:
        """Returns tokens sorted by expert [N, D], tokens per expert [E] (int64), and the state."""
        top_k = topk_idx_TK.shape[1]
        sorted_experts_N, order_N, inverse_N = sort_permutation(topk_idx_TK.reshape(-1))
        x_ND = _RepeatRows.apply(x_TD, order_N, inverse_N, top_k, self._fused(x_TD))
        tokens_per_expert_E = count_per_expert(sorted_experts_N, num_experts)
        state = LocalDispatchState(tokens_per_expert_E, order_N, inverse_N, topk_w_TK)
        return x_ND, tokens_per_expert_E, state

    def combine(self, y_ND: torch.Tensor, state: LocalDispatchState, out_dtype: torch.dtype) -> torch.Tensor:
        """Restores (token, k) order, weights each pair's output in fp32, sums over k in fp32."""
        if self._fused(y_ND):
            return moe_combine.moe_combine(y_ND, state.inverse_N, state.weights_TK).to(out_dtype)
        num_tokens, top_k = state.weights_TK.shape
        y_TKD = permute_rows(y_ND, state.inverse_N, state.order_N).view(num_tokens, top_k, -1)
        return (y_TKD * state.weights_TK.unsqueeze(-1)).sum(dim=1).to(out_dtype)


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """The routed-experts layers of `model` (module docstring: `dispatcher`, `experts`,
    `num_experts`), in `model.modules()` order."""
    return [module for module in model.modules()
            if isinstance(getattr(module, "dispatcher", None), TokenDispatcher)
            and isinstance(getattr(module, "experts", None), nn.Module) and hasattr(module, "num_experts")]
