"""Grouped GEMM over rows grouped by expert: the routed experts' linear layer.

    y[n] = x[n] @ w[e(n)]^T        x [N, I]; w [E, O, I]; y [N, O] in w's dtype

for rows sorted by expert, `offsets[e]` the cumulative row end of expert e (expert e owns
rows offsets[e-1]:offsets[e]). The MoE experts (`glmtune/models/glm5/moe.py`), their
LoRA adapters (`glmtune/kernels/lora_ops.py`, `glmtune/peft/lora.py`), the frozen-FP8
experts (`fp8_matmul.grouped_linear_fp8`) and the fused low-rank add's reference and
backward (`lowrank_add.py`) all compute through `grouped_linear`.

Backends (`BACKENDS`, the model's `moe_backend`):
  grouped_mm  one `torch.nn.functional.grouped_mm` call where it runs (CUDA sm80+; on CPU
              16-byte aligned strides; under torch.compile bf16 only, the one dtype
              inductor lowers); elsewhere it falls back to the loop.
  loop        one matmul per expert over its rows: the reference, with a host sync on
              the offsets.

grouped_mm is tested against the loop in tests/kernels/test_grouped_gemm.py (values and
gradients), both against transformers' logits in tests/parity/test_hf_parity.py; the loop
is also the reference of the FP8 and MoE-combine kernel tests.

Legend: N rows, I input width, O output width, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("grouped_mm", "loop")


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and w.dtype != torch.bfloat16:
        return False  # inductor lowers grouped_mm for bf16 only
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    # The CPU kernel needs 16-byte aligned strides.
    itemsize = w.element_size()
    return all((s * itemsize) % 16 == 0 for s in (w.shape[-1], w.shape[-2], x.shape[-1]))


def grouped_linear(x_ND: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, backend: str) -> torch.Tensor:
    """y[n] = x[n] @ w[e(n)].T for rows grouped by expert; offsets are cumulative row ends."""
    w_EIO = w_EOI.transpose(-2, -1)
    if backend == "grouped_mm" and _grouped_mm_usable(x_ND, w_EOI):
        return F.grouped_mm(x_ND.to(w_EOI.dtype), w_EIO, offs=offsets_E.to(torch.int32))
    out = x_ND.new_empty(x_ND.shape[0], w_EOI.shape[1], dtype=w_EOI.dtype)
    start = 0
    for expert, end in enumerate(offsets_E.tolist()):  # host sync: the reference path only
        if end > start:
            out[start:end] = x_ND[start:end].to(w_EOI.dtype) @ w_EIO[expert]
        start = end
    return out
