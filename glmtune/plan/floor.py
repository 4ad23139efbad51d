"""The seed guide's model-state floor for a whole model, and what LoRA and an FP8 base change.

Bytes per parameter, every parameter of the checkpoint (MTP layers included), before any
activation, buffer or sharding:

  bf16 weights 2 | gradients 2 | Adam moments 8 (two fp32) | fp32 master weights 4
  -> 12 bytes without master weights, 16 with them (GLM-5: 9.0-12.1 TB)

and the alternatives the guide weighs: LoRA keeps the base frozen in bf16 (2 bytes, no
gradient or moments) and trains adapters at 16 bytes each (fp32 adapter, gradient, moments);
an FP8 frozen base stores e4m3 weights with fp32 128 x 128 block scales instead (~1 byte).
Beside them, `recipe` is what glmtune allocates for the recipe itself (its dtypes: bf16
parameters with fp32 masters and moments in the optimizer, bf16-only with bf16 moments, LoRA,
FP8), from the meta model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from glmtune.checkpoint.fp8_layout import SCALE_SUFFIX
from glmtune.models.common.model_spec import ModelSpec
from glmtune.peft.init import adapter_parameter_names
from glmtune.plan.model_state import whole_model_state


@dataclass
class FloorRow:
    what: str
    bytes: int
    note: str = ""


def _fp8_base_bytes(model: nn.Module) -> int:
    """e4m3 weights and fp32 block scales for every matrix (as GLM-5's FP8 checkpoint stores
    them), the rest in bf16; of the model's own parameters (`model_parameters`)."""
    total = 0
    for param in _own_parameters(model):
        if param.dim() >= 2 and param.shape[-1] % 128 == 0 and param.shape[-2] % 128 == 0:
            blocks = param.numel() // (128 * 128)
            total += param.numel() + 4 * blocks
        else:
            total += 2 * param.numel()
    return total


def floor_table(model: nn.Module, lora_model: nn.Module | None = None) -> list[FloorRow]:
    """The guide's rows for `model` (the recipe's, any dtype), then the recipe's own figure.
    `lora_model`: the same architecture with the recipe's (or default) LoRA adapters applied. The
    model's parameters are the checkpoint's: a LoRA recipe's adapters count in the LoRA rows only."""
    n = model_parameters(model)
    rows = [FloorRow("bf16 weights", 2 * n, f"{n:,} parameters x 2 B"),
            FloorRow("gradients (bf16)", 2 * n, "x 2 B"),
            FloorRow("Adam moments (fp32)", 8 * n, "x 8 B"),
            FloorRow("fp32 master weights", 4 * n, "x 4 B"),
            FloorRow("full fine-tuning, without fp32 masters", 12 * n, "weights + gradients + moments"),
            FloorRow("full fine-tuning, with fp32 masters", 16 * n, "the guide's upper figure")]
    if lora_model is not None:
        adapters = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
        base = n  # adapters are extra parameters: the base keeps its count
        rows.append(FloorRow("LoRA on a bf16 base", 2 * base + 16 * adapters,
                             f"frozen base x 2 B + {adapters:,} adapter parameters x 16 B"))
        rows.append(FloorRow("LoRA on an FP8 base", _fp8_base_bytes(model) + 16 * adapters,
                             "e4m3 matrices + fp32 128x128 scales, bf16 rest, adapters x 16 B"))
    return rows


def _own_parameters(model: nn.Module) -> list[nn.Parameter]:
    adapters = adapter_parameter_names(model)
    return [p for name, p in model.named_parameters() if name not in adapters and not name.endswith(SCALE_SUFFIX)]


def model_parameters(model: nn.Module) -> int:
    """The parameters of the model itself: a LoRA recipe's adapters and an FP8 base's block scales (how its
    weights are stored, not parameters) aside, so a LoRA recipe counts what its full fine-tune counts."""
    return sum(p.numel() for p in _own_parameters(model))


def adapter_parameters(model: nn.Module) -> int:
    """The LoRA adapters' parameters of `model` (0 without adapters)."""
    adapters = adapter_parameter_names(model)
    return sum(p.numel() for name, p in model.named_parameters() if name in adapters)


def recipe_row(model: nn.Module, spec: ModelSpec, masters: bool) -> FloorRow:
    """What glmtune holds for this recipe over all ranks (parameters, gradients, AdamW state with
    its fp32 masters when `masters`); `spec`: the model's family (`model_spec`)."""
    state = whole_model_state(model, spec, masters)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    return FloorRow("this recipe (glmtune)", state.total,
                    f"parameters {state.params / 1e12:.2f} TB ({'/'.join(dtypes)}), gradients "
                    f"{state.grads / 1e12:.2f} TB, AdamW {state.optimizer / 1e12:.2f} TB")


