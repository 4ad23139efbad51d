"""LoRA custom ops: adapter products whose sums land in the base product's output.

No [tokens, out] pass is spent on adding the adapter's update. `glmtune/peft/lora.py`
computes its adapters through them.

Dense (`lora_linear`, a frozen base W [out, in]):

    forward   h = x A^T            [T, r]
              y = h B^T, then y += x W^T       (cuBLAS, beta = 1, in place on y)
    backward  g = dy B             [T, r]
              dx = g A, then dx += dy W        (in place again)
              dA = g^T x,  dB = dy^T h

torch.compile lowers `addmm(update, x, W^T)` to an out-of-place GEMM that first copies
`update` into a fresh buffer (1.1 ms a step of device copies on the GLM-5 proxy) and
rewrites the backward's `dy W + g A` the same way; as opaque ops (`glmtune::lora_linear`,
`glmtune::lora_linear_backward`) the accumulation stays in place.

Routed experts (`expert_lora_linear`, per expert e over its rows, a frozen stacked base
W [E, out, in]): the same formulas with grouped GEMMs (`grouped_gemm.py`), and the two
sums (y and dx) through `lowrank_grouped_add` (`lowrank_add.py`), which adds a rank-r
product to a grouped GEMM's output in one pass over it.

B arrives with the LoRA scale folded in; all operands share the compute dtype.
Legend: T tokens (N routed rows for experts), r rank, E experts.
"""

from __future__ import annotations

import torch

from glmtune.kernels.grouped_gemm import grouped_linear
from glmtune.kernels.lowrank_add import lowrank_grouped_add, per_expert_outer


@torch.library.custom_op("glmtune::lora_linear", mutates_args=())
def _lora_linear(x_TI: torch.Tensor, w_OI: torch.Tensor, a_rI: torch.Tensor,
                 b_Or: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h_Tr = torch.mm(x_TI, a_rI.t())
    y_TO = torch.mm(h_Tr, b_Or.t())
    y_TO.addmm_(x_TI, w_OI.t())
    return y_TO, h_Tr


@_lora_linear.register_fake
def _(x_TI, w_OI, a_rI, b_Or):
    return x_TI.new_empty(x_TI.shape[0], w_OI.shape[0]), x_TI.new_empty(x_TI.shape[0], a_rI.shape[0])


@torch.library.custom_op("glmtune::lora_linear_backward", mutates_args=())
def _lora_linear_backward(grad_TO: torch.Tensor, x_TI: torch.Tensor, w_OI: torch.Tensor, a_rI: torch.Tensor,
                          b_Or: torch.Tensor, h_Tr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g_Tr = torch.mm(grad_TO, b_Or)
    grad_x = torch.mm(g_Tr, a_rI)
    grad_x.addmm_(grad_TO, w_OI)
    return grad_x, torch.mm(g_Tr.t(), x_TI), torch.mm(grad_TO.t(), h_Tr)


@_lora_linear_backward.register_fake
def _(grad_TO, x_TI, w_OI, a_rI, b_Or, h_Tr):
    return torch.empty_like(x_TI), torch.empty_like(a_rI), torch.empty_like(b_Or)


def _dense_setup(ctx, inputs, output):
    x_TI, w_OI, a_rI, b_Or = inputs
    ctx.save_for_backward(x_TI, w_OI, a_rI, b_Or, output[1])


def _dense_grad(ctx, grad_TO, _grad_h):
    x_TI, w_OI, a_rI, b_Or, h_Tr = ctx.saved_tensors
    grad_x, grad_a, grad_b = _lora_linear_backward(grad_TO.contiguous(), x_TI, w_OI, a_rI, b_Or, h_Tr)
    return grad_x, None, grad_a, grad_b


_lora_linear.register_autograd(_dense_grad, setup_context=_dense_setup)


def lora_linear(x: torch.Tensor, w_OI: torch.Tensor, a_rI: torch.Tensor, b_Or: torch.Tensor) -> torch.Tensor:
    """x W^T + (x A^T) B^T for a frozen W (no gradient is computed for it); x [..., in]."""
    assert not w_OI.requires_grad, "lora_linear computes no gradient for the base weight"
    y_TO, _ = _lora_linear(x.reshape(-1, x.shape[-1]), w_OI, a_rI, b_Or)
    return y_TO.view(*x.shape[:-1], w_OI.shape[0])


class _ExpertLoRA(torch.autograd.Function):
    """Per expert e: y = x W[e]^T + (x A[e]^T) B[e]^T over the rows grouped by expert."""

    @staticmethod
    def forward(ctx, x_NI, w_EOI, a_ErI, b_EOr, counts_E, backend):
        offsets_E = torch.cumsum(counts_E, 0)
        h_Nr = grouped_linear(x_NI, a_ErI, offsets_E, "grouped_mm")
        y_NO = lowrank_grouped_add(grouped_linear(x_NI, w_EOI, offsets_E, "grouped_mm"), h_Nr, b_EOr, counts_E,
                                   backend)
        ctx.save_for_backward(x_NI, w_EOI, a_ErI, b_EOr, counts_E, h_Nr)
        ctx.backend = backend
        return y_NO

    @staticmethod
    def backward(ctx, grad_NO):
        x_NI, w_EOI, a_ErI, b_EOr, counts_E, h_Nr = ctx.saved_tensors
        offsets_E = torch.cumsum(counts_E, 0)
        offsets_i32 = offsets_E.int()  # grouped_mm's weight-gradient form takes int32 offsets
        grad_NO = grad_NO.contiguous()
        g_Nr = grouped_linear(grad_NO, b_EOr.transpose(1, 2), offsets_E, "grouped_mm")
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            base_grad = grouped_linear(grad_NO, w_EOI.transpose(1, 2), offsets_E, "grouped_mm")
            grad_x = lowrank_grouped_add(base_grad, g_Nr, a_ErI.transpose(1, 2), counts_E, ctx.backend)
        if ctx.needs_input_grad[1]:
            grad_w = per_expert_outer(grad_NO, x_NI, offsets_i32)
        grad_a = per_expert_outer(g_Nr, x_NI, offsets_i32)
        grad_b = per_expert_outer(grad_NO, h_Nr, offsets_i32)
        return grad_x, grad_w, grad_a, grad_b, None, None


def expert_lora_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, a_ErI: torch.Tensor, b_EOr: torch.Tensor,
                       counts_E: torch.Tensor, backend: str) -> torch.Tensor:
    """The routed experts' base product plus their adapters' update, [N, O] in x's dtype."""
    return _ExpertLoRA.apply(x_NI, w_EOI, a_ErI, b_EOr, counts_E, backend)
