"""The absorbed form's sparse attention through the fused Triton kernels, as an autograd op.

`attention_backend: absorbed_triton` computes what "absorbed" computes (`absorbed_attention.py`:
queries [q_nope W_uk | q_rot] over the compressed keys c = [latent | k_rot] each query selected,
values the latent) with `glmtune.kernels.sparse_mla`, which gathers every query's keys on chip
instead of writing them out per block and adds the keys' gradients with atomics instead of an
fp32 [queries, top-k, C] block and `index_add_`. Same signature and layouts as
`glmtune::absorbed_attention`, which is its pure-torch reference.

The op (`glmtune::sparse_mla`) is opaque to torch.compile and saves only its inputs, the
output latent and the fp32 log-sum-exp; activation checkpointing keeps its outputs
(`parallelize.py`).

Legend: B batch, S queries, T keys, N heads, K slots (top-k), R latent rank (values),
C = R + rope dim (keys).
"""

from __future__ import annotations

import os

import torch

from glmtune.kernels import sparse_mla as kernels


def sparse_mla_available() -> bool:
    return kernels.triton is not None


@torch.library.custom_op("glmtune::sparse_mla", mutates_args=())
def sparse_mla(q_BSNC: torch.Tensor, c_BTC: torch.Tensor, index_BSK: torch.Tensor, valid_BSK: torch.Tensor,
               scale: float, value_dim: int, buffer_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, N, R], lse [B, S, N] fp32): each query over the keys of its valid slots.
    `buffer_bytes` is for the backward: its P and dS buffers' bound."""
    batch, queries, heads, width = q_BSNC.shape
    keys = c_BTC.shape[1]
    out, lse = kernels.sparse_mla_forward(q_BSNC.view(batch * queries, heads, width), c_BTC.view(batch * keys, width),
                                          index_BSK.view(batch * queries, -1), valid_BSK.view(batch * queries, -1),
                                          queries, keys, scale, value_dim)
    return out.view(batch, queries, heads, value_dim), lse.view(batch, queries, heads)


@sparse_mla.register_fake
def _(q_BSNC, c_BTC, index_BSK, valid_BSK, scale, value_dim, buffer_bytes):
    batch, queries, heads, _ = q_BSNC.shape
    return (q_BSNC.new_empty(batch, queries, heads, value_dim),
            q_BSNC.new_empty(batch, queries, heads, dtype=torch.float32))


@torch.library.custom_op("glmtune::sparse_mla_backward", mutates_args=())
def sparse_mla_backward(grad_out_BSNR: torch.Tensor, q_BSNC: torch.Tensor, c_BTC: torch.Tensor,
                        index_BSK: torch.Tensor, valid_BSK: torch.Tensor, out_BSNR: torch.Tensor,
                        lse_BSN: torch.Tensor, scale: float, buffer_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [B, S, N, C], dc [B, T, C])."""
    batch, queries, heads, width = q_BSNC.shape
    keys = c_BTC.shape[1]
    flat = batch * queries
    dq, dc = kernels.sparse_mla_backward(
        grad_out_BSNR.view(flat, heads, -1), q_BSNC.view(flat, heads, width), c_BTC.view(batch * keys, width),
        index_BSK.view(flat, -1), valid_BSK.view(flat, -1), out_BSNR.view(flat, heads, -1),
        lse_BSN.view(flat, heads), queries, keys, scale, buffer_bytes)
    return dq.view(q_BSNC.shape), dc.view(c_BTC.shape)


@sparse_mla_backward.register_fake
def _(grad_out_BSNR, q_BSNC, c_BTC, index_BSK, valid_BSK, out_BSNR, lse_BSN, scale, buffer_bytes):
    return q_BSNC.new_empty(q_BSNC.shape), c_BTC.new_empty(c_BTC.shape)


def _setup_context(ctx, inputs, output):
    q, c, index, valid, scale, _, buffer_bytes = inputs
    out, lse = output
    ctx.save_for_backward(q, c, index, valid, out, lse)
    ctx.options = (scale, buffer_bytes)


def _backward(ctx, grad_out, grad_lse):
    q, c, index, valid, out, lse = ctx.saved_tensors
    dq, dc = sparse_mla_backward(grad_out.contiguous(), q, c, index, valid, out, lse, *ctx.options)
    return dq, dc, None, None, None, None, None


sparse_mla.register_autograd(_backward, setup_context=_setup_context)


def fused_absorbed_attention(q_BSNC: torch.Tensor, c_BTC: torch.Tensor, index_BSK: torch.Tensor,
                             valid_BSK: torch.Tensor, scale: float, value_dim: int,
                             buffer_bytes: int = kernels.BUFFER_BYTES) -> torch.Tensor:
    """The output latent [B, S, N, R] (`glmtune::absorbed_attention`'s contract) from the fused kernels;
    the backward's P and dS buffers take at most `buffer_bytes` each (`model.attention_score_buffer_mib`)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests run the kernels interpreted
    if not (q_BSNC.is_cuda or interpreted) or not sparse_mla_available():
        raise ValueError("model.attention_backend 'absorbed_triton' runs Triton kernels on a CUDA GPU; use "
                         "'absorbed' (its pure-torch form) elsewhere")
    if q_BSNC.is_cuda and q_BSNC.dtype not in (torch.bfloat16, torch.float16):
        # Triton's GPU dots would round fp32 inputs to TF32: not the exact fp32 attention asked for.
        raise ValueError(f"model.attention_backend 'absorbed_triton' takes bf16 or fp16 on the GPU, got "
                         f"{q_BSNC.dtype}; use 'absorbed' for fp32 models")
    return sparse_mla(q_BSNC, c_BTC, index_BSK, valid_BSK, scale, value_dim, buffer_bytes)[0]
