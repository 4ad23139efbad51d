"""The absorbed form's sparse attention through the fused Triton kernels, as an autograd op.

`attention_backend: absorbed_triton` computes what "absorbed" computes (`absorbed_attention.py`:
queries [q_nope W_uk | q_rot] over the compressed keys c = [latent | k_rot] each query selected,
values the latent) with `glmtune.kernels.sparse_mla`, which gathers every query's keys on chip
instead of writing them out per block and adds the keys' gradients with atomics instead of an
fp32 [queries, top-k, C] block and `index_add_`. `glmtune::absorbed_attention` is its pure-torch
reference; here the queries and the keys come as their latent and rope parts, so that no caller
concatenates them (`glmtune.kernels.sparse_mla`).

The op (`glmtune::sparse_mla`) is opaque to torch.compile and saves only its inputs, the
output latent and the fp32 log-sum-exp; activation checkpointing keeps its outputs
(`parallelize.py`).

Legend: B batch, S queries, T keys, N heads, K slots (top-k), R latent rank (the values),
E rope dim (keys are R + E wide).
"""

from __future__ import annotations

import os

import torch

from glmtune.kernels import sparse_mla as kernels


def sparse_mla_available() -> bool:
    return kernels.triton is not None


def _rows(x_BSNX: torch.Tensor) -> torch.Tensor:
    """[B x S, N, X] for the kernels, which take any query and head strides but a unit column one: a
    view where B and S merge (the einsums' head-major outputs do), else a copy."""
    x_MNX = x_BSNX.reshape(-1, *x_BSNX.shape[2:])
    return x_MNX if x_MNX.stride(-1) == 1 else x_MNX.contiguous()


@torch.library.custom_op("glmtune::sparse_mla", mutates_args=())
def sparse_mla(q_lat_BSNR: torch.Tensor, q_rot_BSNE: torch.Tensor, c_lat_BTR: torch.Tensor, c_rot_BTE: torch.Tensor,
               index_BSK: torch.Tensor, valid_BSK: torch.Tensor, scale: float,
               buffer_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, N, R], lse [B, S, N] fp32): each query over the keys of its valid slots.
    `buffer_bytes` is for the backward: its P and dS buffers' bound."""
    batch, queries, heads, latent = q_lat_BSNR.shape
    flat = batch * queries
    out, lse = kernels.sparse_mla_forward(_rows(q_lat_BSNR), _rows(q_rot_BSNE), c_lat_BTR, c_rot_BTE,
                                          index_BSK.view(flat, -1), valid_BSK.view(flat, -1), queries, scale)
    return out.view(batch, queries, heads, latent), lse.view(batch, queries, heads)


@sparse_mla.register_fake
def _(q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE, index_BSK, valid_BSK, scale, buffer_bytes):
    batch, queries, heads, _ = q_lat_BSNR.shape
    return q_lat_BSNR.new_empty(q_lat_BSNR.shape), q_lat_BSNR.new_empty(batch, queries, heads, dtype=torch.float32)


@torch.library.custom_op("glmtune::sparse_mla_backward", mutates_args=())
def sparse_mla_backward(grad_out_BSNR: torch.Tensor, q_lat_BSNR: torch.Tensor, q_rot_BSNE: torch.Tensor,
                        c_lat_BTR: torch.Tensor, c_rot_BTE: torch.Tensor, index_BSK: torch.Tensor,
                        valid_BSK: torch.Tensor, out_BSNR: torch.Tensor, lse_BSN: torch.Tensor, scale: float,
                        buffer_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_lat [B, S, N, R], dq_rot [B, S, N, E], dc_lat [B, T, R], dc_rot [B, T, E])."""
    batch, queries, heads, latent = q_lat_BSNR.shape
    flat = batch * queries
    dq_lat, dq_rot, dc_lat, dc_rot = kernels.sparse_mla_backward(
        _rows(grad_out_BSNR), _rows(q_lat_BSNR), _rows(q_rot_BSNE), c_lat_BTR, c_rot_BTE, index_BSK.view(flat, -1),
        valid_BSK.view(flat, -1), out_BSNR.view(flat, heads, latent), lse_BSN.view(flat, heads), queries, scale,
        buffer_bytes)
    return dq_lat.view(q_lat_BSNR.shape), dq_rot.view(q_rot_BSNE.shape), dc_lat, dc_rot


@sparse_mla_backward.register_fake
def _(grad_out_BSNR, q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE, index_BSK, valid_BSK, out_BSNR, lse_BSN, scale,
      buffer_bytes):
    return (q_lat_BSNR.new_empty(q_lat_BSNR.shape), q_rot_BSNE.new_empty(q_rot_BSNE.shape),
            c_lat_BTR.new_empty(c_lat_BTR.shape), c_rot_BTE.new_empty(c_rot_BTE.shape))


def _setup_context(ctx, inputs, output):
    q_lat, q_rot, c_lat, c_rot, index, valid, scale, buffer_bytes = inputs
    out, lse = output
    ctx.save_for_backward(q_lat, q_rot, c_lat, c_rot, index, valid, out, lse)
    ctx.options = (scale, buffer_bytes)


def _backward(ctx, grad_out, grad_lse):
    q_lat, q_rot, c_lat, c_rot, index, valid, out, lse = ctx.saved_tensors
    return (*sparse_mla_backward(grad_out, q_lat, q_rot, c_lat, c_rot, index, valid, out, lse, *ctx.options),
            None, None, None, None)


sparse_mla.register_autograd(_backward, setup_context=_setup_context)


def fused_absorbed_attention(q_lat_BSNR: torch.Tensor, q_rot_BSNE: torch.Tensor, c_lat_BTR: torch.Tensor,
                             c_rot_BTE: torch.Tensor, index_BSK: torch.Tensor, valid_BSK: torch.Tensor, scale: float,
                             buffer_bytes: int = kernels.BUFFER_BYTES) -> torch.Tensor:
    """The output latent [B, S, N, R] (`glmtune::absorbed_attention`'s contract, its queries and keys
    given as their latent and rope parts) from the fused kernels; the backward's P and dS buffers take
    at most `buffer_bytes` each (`model.attention_score_buffer_mib`)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests run the kernels interpreted
    if not (q_lat_BSNR.is_cuda or interpreted) or not sparse_mla_available():
        raise ValueError("model.attention_backend 'absorbed_triton' runs Triton kernels on a CUDA GPU; use "
                         "'absorbed' (its pure-torch form) elsewhere")
    if q_lat_BSNR.is_cuda and q_lat_BSNR.dtype not in (torch.bfloat16, torch.float16):
        # Triton's GPU dots would round fp32 inputs to TF32: not the exact fp32 attention asked for.
        raise ValueError(f"model.attention_backend 'absorbed_triton' takes bf16 or fp16 on the GPU, got "
                         f"{q_lat_BSNR.dtype}; use 'absorbed' for fp32 models")
    # Unit column strides for the kernels' row loads (the layer's splits and einsums have them already).
    q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE = (x if x.stride(-1) == 1 else x.contiguous()
                                                    for x in (q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE))
    return sparse_mla(q_lat_BSNR, q_rot_BSNE, c_lat_BTR, c_rot_BTE, index_BSK, valid_BSK, scale, buffer_bytes)[0]
