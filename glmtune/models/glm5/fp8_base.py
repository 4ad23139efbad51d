"""A frozen FP8 base: GLM-5's linear layers and routed experts held as e4m3 weights with
128 x 128 block scales (the layout of the official FP8 checkpoints), computed without a
dequantized copy of the model (`glmtune/kernels/fp8_matmul.py`).

`convert_to_fp8_base(model)` turns a built model's quantizable layers FP8 in place, as
`apply_lora` turns layers into adapters: the MLA projections, the dense MLPs and shared
experts (`Fp8Linear`), and every layer's routed experts (`GroupedExperts` whose
`gate_up_proj` / `down_proj` become e4m3 with `gate_up_proj_scale_inv` /
`down_proj_scale_inv` beside them). What the official checkpoints keep in bf16 stays
bf16: embeddings, the LM head, norms, routers (fp32) and the DSA indexer. Names are those
of the HF checkpoint (`...q_a_proj.weight`, `...q_a_proj.weight_scale_inv`), so an FP8
checkpoint's tensors load as they are.

A model on the meta device gets meta FP8 tensors (a sharded load fills them); otherwise
the current weights are quantized (each block's absmax / 448). Every FP8 weight is
frozen: only adapters train on an FP8 base.
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.kernels import fp8_blocks
from glmtune.kernels.fp8_matmul import BACKENDS, linear_fp8
from glmtune.models.glm5.moe import GroupedExperts


class Fp8Linear(nn.Linear):
    """A bias-free nn.Linear whose weight is frozen e4m3 [out, in] with fp32 block scales."""

    def __init__(self, in_features: int, out_features: int, backend: str = "dequant",
                 device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.fp8_backend = in_features, out_features, backend
        weight = torch.empty(out_features, in_features, dtype=fp8_blocks.E4M3, device=device)
        scale = torch.empty(fp8_blocks.scale_shape((out_features, in_features)), dtype=torch.float32, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str, errors: list | None = None) -> "Fp8Linear":
        assert linear.bias is None, "GLM-5's quantized projections have no bias"
        module = cls(linear.in_features, linear.out_features, backend, device=linear.weight.device)
        if linear.weight.device.type != "meta":
            with torch.no_grad():
                q, scale = _quantize(linear.weight, errors)
                module.weight.copy_(q)
                module.weight_scale_inv.copy_(scale)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fp8(x, self.weight, self.weight_scale_inv, self.fp8_backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128, {self.fp8_backend}"


@torch.no_grad()
def _quantize(weight: torch.Tensor, errors: list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight`, adding (squared error, squared norm) to `errors` when given."""
    if errors is None:
        return fp8_blocks.quantize_weight(weight)
    q, scale, squares = fp8_blocks.quantize_weight_with_error(weight)
    errors.append(squares)
    return q, scale


def _quantize_experts(experts: GroupedExperts, errors: list | None) -> None:
    for proj in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, proj)
        if weight.device.type == "meta":
            q = torch.empty(weight.shape, dtype=fp8_blocks.E4M3, device="meta")
            scale = torch.empty(fp8_blocks.scale_shape(tuple(weight.shape)), device="meta")
        else:
            q, scale = _quantize(weight, errors)
        setattr(experts, proj, nn.Parameter(q, requires_grad=False))
        experts.register_parameter(f"{proj}_scale_inv", nn.Parameter(scale, requires_grad=False))


def _quantized(name: str, module: nn.Module) -> bool:
    """The layers the official FP8 checkpoints store in e4m3."""
    if isinstance(module, GroupedExperts):
        return True
    if not isinstance(module, nn.Linear) or isinstance(module, Fp8Linear):
        return False
    dotted = f".{name}."
    return (".self_attn." in dotted and ".indexer." not in dotted) or ".mlp." in dotted


def convert_to_fp8_base(model: nn.Module, backend: str = "dequant", errors: list | None = None) -> list[str]:
    """Makes `model`'s quantizable layers frozen FP8 in place; returns their names. With
    `errors` (a list), each quantized weight appends its (squared error, squared norm)."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 matmul backend {backend!r} unknown; choose from {BACKENDS}")
    converted = []
    for name, module in list(model.named_modules()):
        if not _quantized(name, module):
            continue
        if isinstance(module, GroupedExperts):
            if getattr(module, "gate_up_proj_scale_inv", None) is None:
                _quantize_experts(module, errors)
            module.fp8_backend = backend
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(module, backend, errors))
        converted.append(name)
    return converted
