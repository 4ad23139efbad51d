"""Compute kernels: Triton kernels, each a backend with a pure-torch reference beside it,
and the custom ops and GEMMs the model and the adapters compute through.

The lowest floor with io/: a kernel imports nothing of glmtune outside kernels/.

  adamw             the AdamW update, one program per parameter tensor
  cross_entropy     cross-entropy of a slice of logits and its gradient, in place
  fp8_blocks        the blockwise FP8 checkpoint format (quantize, dequantize)
  fp8_grouped_gemm  the routed experts' FP8-weight grouped GEMM, tiles dequantized in registers
  fp8_matmul        products with a frozen FP8 weight, dense and routed experts
  grouped_gemm      the grouped GEMM over rows grouped by expert (`grouped_linear`)
  indexer_scores    the DSA indexer's scores, fused
  lora_ops          LoRA custom ops whose sums land in the base product's output
  lowrank_add       expert-grouped rows plus a low-rank product, in one pass
  moe_combine       MoE token movement (combine, dispatch backward)
  scale             in-place multiply by a 0-dim device tensor
  sparse_attention  flash attention over a boolean key mask (the DSA top-k tail)
"""
