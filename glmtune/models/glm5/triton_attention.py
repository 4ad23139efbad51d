"""The DSA top-k tail through the masked flash-attention Triton kernels, as an autograd op.

`attention_backend: triton` keeps the "sdpa" backend's exact causal prefix (cuDNN/flash
with `is_causal=True`) and runs every later query in one call of
`glmtune.kernels.sparse_attention`, which reads the boolean top-k mask per tile instead of
handing SDPA a dense mask. The op (`glmtune::sparse_attention`) is opaque to
torch.compile and saves only q, k, v, the output and the fp32 log-sum-exp; the mask is
the layer's own selection, already alive for the backward. q, k and v are read through
their strides (the model's head-split views), never copied.

Legend: B batch, N heads, S queries, T keys, K qk head dim, V value head dim.
"""

from __future__ import annotations

import torch

from glmtune.kernels import sparse_attention as kernels
from glmtune.kernels.sparse_attention import sparse_attention_backward, sparse_attention_forward
from glmtune.models.glm5.gemm_attention import attention_outputs_like, register_attention_autograd


def triton_attention_available() -> bool:
    return kernels.triton is not None


@torch.library.custom_op("glmtune::sparse_attention", mutates_args=())
def sparse_attention(q_BNSK: torch.Tensor, k_BNTK: torch.Tensor, v_BNTV: torch.Tensor, allowed_BST: torch.Tensor,
                     scale: float, score_buffer_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, N, S, V], lse [B, N, S] fp32): the last S of the T keys' queries over the allowed
    keys. `score_buffer_bytes` is for the backward: its dS and P buffers' bound."""
    return sparse_attention_forward(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale)


sparse_attention.register_fake(attention_outputs_like)


@torch.library.custom_op("glmtune::sparse_attention_backward", mutates_args=())
def sparse_attention_grads(grad_out_BNSV: torch.Tensor, q_BNSK: torch.Tensor, k_BNTK: torch.Tensor,
                           v_BNTV: torch.Tensor, out_BNSV: torch.Tensor, lse_BNS: torch.Tensor,
                           allowed_BST: torch.Tensor, scale: float, score_buffer_bytes: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sparse_attention_backward(grad_out_BNSV, q_BNSK, k_BNTK, v_BNTV, out_BNSV, lse_BNS, allowed_BST, scale,
                                     ds_buffer_bytes=score_buffer_bytes, p_buffer_bytes=score_buffer_bytes)


@sparse_attention_grads.register_fake
def _(grad_out_BNSV, q_BNSK, k_BNTK, v_BNTV, out_BNSV, lse_BNS, allowed_BST, scale, score_buffer_bytes):
    # Contiguous, whatever the inputs' strides (empty_like would copy a view's strides).
    return q_BNSK.new_empty(q_BNSK.shape), k_BNTK.new_empty(k_BNTK.shape), v_BNTV.new_empty(v_BNTV.shape)


register_attention_autograd(sparse_attention, sparse_attention_grads)


def triton_masked_attention(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale: float,
                            score_buffer_bytes: int = kernels.SCORE_BUFFER_BYTES) -> torch.Tensor:
    """`attention.sdpa_attention`'s `masked` callable: queries are the last S of the T keys.
    The backward materializes dS and P (bf16, [B, N, S, T] each) while each takes at most
    `score_buffer_bytes`, and recomputes them in its kernels otherwise."""
    if q_BNSK.is_cuda and q_BNSK.dtype not in (torch.bfloat16, torch.float16):
        # Triton's GPU dots would round fp32 inputs to TF32: not the exact fp32 attention asked for.
        raise ValueError(f"attention_backend 'triton' takes bf16 or fp16 on the GPU, got {q_BNSK.dtype}; "
                         "use 'sdpa' (or 'auto') for fp32 models")
    return sparse_attention(q_BNSK, k_BNTK, v_BNTV, allowed_BST, scale, score_buffer_bytes)[0]
