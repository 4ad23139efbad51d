"""Causal-LM loss that never materializes fp32 logits over the whole vocabulary.

`chunked_cross_entropy` runs the LM head and cross-entropy over slices of tokens,
so at most one slice of [chunk, V] fp32 logits is alive at a time (for GLM-5's
154,880-token vocabulary at 4K tokens the full tensor would be 2.5 GB). Two
backends:
  * "fused" (default when gradients are needed): the gradient of the loss with
    respect to the hidden states and the head weight is computed in the forward
    pass, slice by slice (softmax minus one-hot, two GEMMs, weight gradient
    accumulated in the weight dtype), and only scaled in backward: no logits are recomputed
    and no fp32 logits outlive their slice. On CUDA the softmax/one-hot step of a slice is
    one Triton kernel writing over the slice's bf16 logits (the eager function is its
    reference). A caller that knows the factor it will divide the loss by (`grad_scale`,
    e.g. 1 / tokens in the step) has it folded into the head-gradient GEMM (its alpha), so
    backward does not rescale GLM-5's 1.9 GB head gradient.
  * "checkpoint": autograd through each slice, recomputed in backward.
`full_cross_entropy` is the plain reference both are tested against.

`chunked_token_logps` gives the per-token log-probabilities themselves (preference losses
sum them per document), under the same one-slice-at-a-time bound: its backward recomputes
each slice's logits and applies d logp / d logits = one_hot - softmax, scaled per token.

Targets are next-token ids aligned with the inputs (`targets[t]` is the token
that should follow position t, -100 where no loss applies), so no shift happens
here and packed rows never predict across a document boundary.

Legend: N tokens, D model dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from glmtune.kernels import cross_entropy, scale

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                    greedy_N: torch.Tensor | None = None) -> torch.Tensor:
    logits_NV = F.linear(hidden_ND, weight_VD)
    if greedy_N is not None:
        greedy_N.copy_(logits_NV.argmax(-1))
    return F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX, reduction="sum")


def _slice_loss_and_grad(logits_NV: torch.Tensor, targets_N: torch.Tensor,
                         greedy_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 loss sum of one slice and d(loss)/d(logits) = softmax - one_hot, in the logits' dtype;
    each row's argmax into `greedy_N` when given."""
    if greedy_N is not None:
        greedy_N.copy_(logits_NV.argmax(-1))
    logits = logits_NV.float()
    lse_N = torch.logsumexp(logits, dim=-1)
    loss = (lse_N - logits.gather(1, targets_N[:, None]).squeeze(1)).sum()
    columns = torch.arange(logits.shape[1], device=logits.device)
    one_hot = (columns[None, :] == targets_N[:, None]).to(logits.dtype)
    return loss, (torch.exp(logits - lse_N[:, None]) - one_hot).to(logits_NV.dtype)


def slice_loss_and_grad(logits_NV, targets_N, fused: bool | None = None, greedy_N: torch.Tensor | None = None):
    """(fp32 loss sum, d(loss)/d(logits)) of one slice, and each row's greedy token (its logits'
    argmax) into `greedy_N` when given. Fused (the default on CUDA with triton): one Triton kernel
    that writes the gradient over the logits (`glmtune.kernels.cross_entropy`); otherwise the eager
    reference above."""
    if fused is None:
        fused = logits_NV.is_cuda and cross_entropy.triton is not None
    if fused:
        return cross_entropy.cross_entropy_grad_(logits_NV, targets_N, greedy_N), logits_NV
    return _slice_loss_and_grad(logits_NV, targets_N, greedy_N)


def scale_in_place(tensors, factor_0d: torch.Tensor) -> None:
    """Multiplies each tensor by a 0-dim tensor without a host sync: on CUDA through
    `glmtune.kernels.scale` (eager `mul_` with a 0-dim CUDA operand is unvectorized)."""
    for tensor in tensors:
        if tensor.is_cuda and scale.triton is not None:
            scale.scale_(tensor, factor_0d.to(tensor.device))
        else:
            tensor.mul_(factor_0d)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy losses of `hidden @ weight.T`, gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, chunk_size, grad_scale, backward_twice, greedy_N):
        # Only the gradients autograd will ask for: a frozen head (LoRA) skips the V x D
        # weight-gradient GEMM and its buffer (a third of the head's cost).
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_ND) if need_hidden else None
        # Accumulated in the weight's dtype with one rounding per slice (what autograd would do
        # across slices); an fp32 buffer would cost 4 bytes x V x D (3.8 GB for GLM-5's head).
        # The first slice writes it (no zero fill, no read of zeros), later ones add to it.
        grad_weight = None
        if need_weight:
            grad_weight = torch.empty_like(weight_VD) if hidden_ND.shape[0] else torch.zeros_like(weight_VD)
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        alpha = 1.0 if grad_scale is None else grad_scale
        for start in range(0, hidden_ND.shape[0], chunk_size):
            h = hidden_ND[start : start + chunk_size]
            t = targets_N[start : start + chunk_size]
            greedy = None if greedy_N is None else greedy_N[start : start + chunk_size]
            loss, dlogits = slice_loss_and_grad(F.linear(h, weight_VD), t, greedy_N=greedy)
            total += loss
            if need_hidden:
                grad_hidden[start : start + chunk_size] = dlogits @ weight_VD
            if need_weight:
                # beta=0 on the first slice: the uninitialized output is ignored (no NaN propagated).
                grad_weight.addmm_(dlogits.T, h.to(weight_VD.dtype), beta=0 if start == 0 else 1, alpha=alpha)
        # Kept as attributes, not saved tensors: backward scales them in place, and zero-bubble
        # pipeline schedules run backward twice (input gradients, then weight gradients,
        # `backward_twice`); the second call returns what the first computed (`scaled`).
        ctx.grads, ctx.scaled, ctx.backward_twice = (grad_hidden, grad_weight), False, backward_twice
        ctx.grad_scale = grad_scale
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.grads
        # Released once returned (after the second call under `backward_twice`): the node outlives
        # its backward (a pipeline schedule keeps each microbatch's output to the step's end), and a
        # V x D gradient held there stays allocated, one per microbatch (measured: 7.1 GiB on the
        # last stage of recipes/glm5/sft_4k.yaml, 14.2 with the MTP loss), and makes autograd copy
        # it into the parameter's .grad instead of taking it over.
        if ctx.scaled or not ctx.backward_twice:
            ctx.grads = None
        if ctx.scaled:
            return grad_hidden, grad_weight, None, None, None, None, None
        ctx.scaled = True
        if grad_hidden is not None:
            scale_in_place((grad_hidden,), grad_total)
        if grad_weight is not None:
            # The head gradient already carries grad_scale; what is left is 1 when the caller's
            # factor was the announced one (the scaling kernel then skips the 1.9 GB pass).
            scale_in_place((grad_weight,), grad_total if ctx.grad_scale is None else grad_total / ctx.grad_scale)
        return grad_hidden, grad_weight, None, None, None, None, None


LOSS_BACKENDS = ("fused", "checkpoint")


def chunked_cross_entropy(
    hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, targets_BS: torch.Tensor, chunk_size: int = 4096,
    backend: str = "fused", num_supervised: int | None = None, grad_scale: float | None = None,
    backward_twice: bool = False, greedy_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token losses and the number of supervised tokens.

    `grad_scale`: the factor the caller will multiply the loss sum by before backward, when
    known on the host; the fused backend computes its gradients already scaled by it (any
    other factor still gives exact gradients, through a scaling pass in backward).

    `backward_twice`: a zero-bubble pipeline schedule will call backward a second time (weight
    gradients after input gradients); the first call's gradients are kept for it.

    `num_supervised`, the count of targets != -100 when the caller knows it on the host
    (the data loader does), spares the host sync of finding the supervised rows.

    `greedy_BS` (int64, the targets' shape), when given, receives each supervised position's
    greedy token, the argmax of the logits the loss computed (no second head GEMM), and -1 at
    every other position.
    """
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    targets_N = targets_BS.reshape(-1)
    keep_N = targets_N != IGNORE_INDEX
    num_tokens = keep_N.sum()
    # Only supervised positions pay for the LM head (assistant-only loss skips most). Without
    # the host-side count, one host sync here (how many); index_select's backward is a
    # scatter with no second sync or sort.
    if num_supervised is None:
        kept = keep_N.nonzero().squeeze(1)
    else:
        kept = keep_N.nonzero_static(size=num_supervised).squeeze(1)
    hidden_ND, targets_N = hidden_ND.index_select(0, kept), targets_N.index_select(0, kept)
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"loss backend {backend!r} unknown; choose from {LOSS_BACKENDS}")
    greedy_N = None if greedy_BS is None else targets_N.new_empty(targets_N.shape)  # the kept rows'
    if backend == "fused" and torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        total = _FusedLinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, chunk_size, grad_scale,
                                               backward_twice, greedy_N)
    else:
        total = hidden_ND.new_zeros((), dtype=torch.float32)
        # At least one (possibly empty) slice: with no supervised token the loss is still a graph node.
        for start in range(0, max(hidden_ND.shape[0], 1), chunk_size):
            h, t = hidden_ND[start : start + chunk_size], targets_N[start : start + chunk_size]
            greedy = None if greedy_N is None else greedy_N[start : start + chunk_size]
            if torch.is_grad_enabled():
                total = total + checkpoint(_chunk_loss_sum, h, weight_VD, t, use_reentrant=False)
                if greedy is not None:  # a head pass of their own: checkpoint's inputs must not be written
                    with torch.no_grad():
                        greedy.copy_(F.linear(h, weight_VD).argmax(-1))
            else:
                total = total + _chunk_loss_sum(h, weight_VD, t, greedy)
    if greedy_BS is not None:
        assert greedy_BS.shape == targets_BS.shape and greedy_BS.is_contiguous(), greedy_BS.shape
        greedy_BS.view(-1).fill_(-1).index_copy_(0, kept, greedy_N)
    return total, num_tokens


class _ChunkedTokenLogps(torch.autograd.Function):
    """log p(target) per supervised row of `hidden @ weight.T`, one [chunk, V] fp32 slice at a time.

    Unlike the fused cross-entropy, the upstream gradient is per token (a preference loss
    weighs each document differently), so the gradients cannot be formed in forward: backward
    recomputes each slice's logits (one more head GEMM) from the saved fp32 log-normalizers.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, chunk_size):
        logp_N = hidden_ND.new_empty(hidden_ND.shape[0], dtype=torch.float32)
        lse_N = torch.empty_like(logp_N)
        for start in range(0, hidden_ND.shape[0], chunk_size):
            end = start + chunk_size
            logits = F.linear(hidden_ND[start:end], weight_VD).float()
            lse_N[start:end] = torch.logsumexp(logits, dim=-1)
            logp_N[start:end] = logits.gather(1, targets_N[start:end, None]).squeeze(1) - lse_N[start:end]
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N)
        ctx.chunk_size = chunk_size
        return logp_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_N):
        hidden_ND, weight_VD, targets_N, lse_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_ND) if need_hidden else None
        # Accumulated in the weight's dtype, one rounding per slice, as the fused cross-entropy does.
        grad_weight = torch.zeros_like(weight_VD) if need_weight else None
        chunk_size = ctx.chunk_size
        for start in range(0, hidden_ND.shape[0], chunk_size):
            end = start + chunk_size
            h, t, g = hidden_ND[start:end], targets_N[start:end], grad_logp_N[start:end].float()
            # d logp / d logits = one_hot - softmax, times the incoming gradient of each token;
            # built in place over the slice's fp32 logits (the only [chunk, V] buffer alive).
            dlogits = F.linear(h, weight_VD).float().sub_(lse_N[start:end, None]).exp_().mul_(-g[:, None])
            dlogits.scatter_add_(1, t[:, None], g[:, None])
            dlogits = dlogits.to(weight_VD.dtype)
            if need_hidden:
                grad_hidden[start:end] = dlogits @ weight_VD
            if need_weight:
                grad_weight.addmm_(dlogits.T, h.to(weight_VD.dtype))
        return grad_hidden, grad_weight, None, None


def chunked_token_logps(hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, targets_BS: torch.Tensor,
                        chunk_size: int = 4096, num_supervised: int | None = None) -> torch.Tensor:
    """fp32 log p(targets[b, s]) under `hidden @ weight.T` where the target is not -100, 0 elsewhere.

    Only supervised positions pay for the LM head, and at most one [chunk, V] fp32 slice of
    logits is alive in forward and in backward. `num_supervised` (the count of targets != -100,
    known on the host) spares the host sync of finding the supervised rows, as in
    `chunked_cross_entropy`.
    """
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    targets_N = targets_BS.reshape(-1)
    keep_N = targets_N != IGNORE_INDEX
    if num_supervised is None:
        kept = keep_N.nonzero().squeeze(1)
    else:
        kept = keep_N.nonzero_static(size=num_supervised).squeeze(1)
    logp_K = _ChunkedTokenLogps.apply(hidden_ND.index_select(0, kept), weight_VD, targets_N.index_select(0, kept),
                                      chunk_size)
    # index_copy keeps the result connected to the graph even with no supervised token.
    logp_N = hidden_ND.new_zeros(targets_N.shape[0], dtype=torch.float32).index_copy(0, kept, logp_K)
    return logp_N.view(targets_BS.shape)


def full_token_logps(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Reference: fp32 log-softmax over materialized logits, gathered at the targets (0 where -100)."""
    logp_BSV = torch.log_softmax(logits_BSV.float(), dim=-1)
    keep_BS = targets_BS != IGNORE_INDEX
    logp_BS = logp_BSV.gather(-1, targets_BS.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(keep_BS, logp_BS, torch.zeros_like(logp_BS))


def full_cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: fp32 cross-entropy over materialized logits (sum, count)."""
    targets_N = targets_BS.reshape(-1)
    loss = F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), targets_N,
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets_N != IGNORE_INDEX).sum()


@torch.no_grad()
def chunked_greedy(hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """int64 [B, S]: the argmax token of `hidden @ weight.T` at every position, one [chunk, V]
    slice of logits at a time (greedy decoding's choice, without the logits)."""
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    greedy_N = torch.empty(hidden_ND.shape[0], dtype=torch.long, device=hidden_ND.device)
    for start in range(0, hidden_ND.shape[0], chunk_size):
        greedy_N[start:start + chunk_size] = F.linear(hidden_ND[start:start + chunk_size], weight_VD).argmax(-1)
    return greedy_N.view(hidden_BSD.shape[:-1])

