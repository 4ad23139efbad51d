"""LoRA modules that replace a built model's leaves in place: dense `nn.Linear`s and
the stacked routed experts.

Both keep the *same* base `Parameter` objects as the module they replace (no copy,
same names: `...q_a_proj.weight`, `...experts.gate_up_proj`), so checkpoints of the
base, FSDP plans keyed by name and `save_pretrained` see the base unchanged. The
adapters are fp32 whatever the base dtype (master weights: updates of 1e-4 relative do
not round away); their products run in the base's dtype by default (`LoraSpec.compute`:
"base", bf16 GEMMs, grouped for the experts) or in fp32 as PEFT does ("fp32", the
reference the fast path is tested against).

    LoRALinear          y = x W^T (+ b) + s * B(A(dropout(x)))       A [r, in], B [out, r]
    LoRAGroupedExperts  per expert e, on the tokens routed to e only:
                        gate_up += s * B_gu[e] A_gu[e] x              A_gu [E, r, D], B_gu [E, 2I, r]
                        down    += s * B_d[e]  A_d[e]  h              A_d  [E, r, I], B_d  [E, D, r]

Gate and up share one A per expert: the adapter is a LoRA on the fused [2I, D]
matrix, exactly what PEFT's `target_parameters` builds for transformers' stacked
`gate_up_proj`, so the PEFT export is a reshape with nothing to approximate; the
per-expert (serving-engine) export writes that A for both gate_proj and up_proj.

The expert adapters run as grouped GEMMs (`grouped_linear`) over the same
expert-sorted tokens and offsets as the base experts: no Python loop over experts on
the fast path, and an expert that receives no token gets no gradient. Experts whose
forward the family does not own (transformers' stacked experts, the hf family:
`LoraRules.folds_experts`) take the same adapters as `LoRAFoldedExperts`: folded into
the stacked weights their forward reads (W + s * B @ A per expert, as PEFT's
`target_parameters` applies them), the same parameters and exports.

s = alpha / r, or alpha / sqrt(r) with rsLoRA. A is kaiming-uniform (a = sqrt(5),
i.e. U(-1/sqrt(in), 1/sqrt(in)), as PEFT initialises it) and B is zero, so a fresh
adapter leaves the model's output unchanged. A module initialises its own adapters
from the global RNG unless built with `init=False`: `apply_lora` draws them for the
whole model from one seeded generator instead (`peft/init.py`), the same values for a
sharded model as for a whole one.

Legend: N routed (token, expert) pairs, D model dim, I expert width, E experts, r rank.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from glmtune.kernels.fp8_matmul import linear_fp8
from glmtune.kernels.grouped_gemm import grouped_linear
from glmtune.kernels.lora_ops import expert_lora_linear, lora_linear
from glmtune.kernels.lowrank_add import resolve_backend

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """Hyper-parameters shared by every adapter of one model."""

    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False
    # "base": the fp32 adapters are cast to the base's dtype for their products (bf16
    # GEMMs: the fast path, grouped GEMMs for experts under torch.compile); "fp32": inputs
    # are cast up and the products run in fp32, as PEFT computes (the reference).
    compute: str = "base"
    # The routed experts' sums of base and update (`glmtune/kernels/lowrank_add.py`): "triton"
    # fuses them into one pass, "torch" is a grouped GEMM and an add; "auto": triton on CUDA.
    kernel: str = "auto"

    def compute_dtype(self, base_dtype: torch.dtype) -> torch.dtype:
        return base_dtype if self.compute == "base" else torch.float32

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


@torch.no_grad()
def init_pair(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """A kaiming-uniform per (expert) matrix with fan_in = its last dim; B zero."""
    # A 2-D view makes fan_in the input width even for stacked [E, r, in] tensors.
    nn.init.kaiming_uniform_(a.view(-1, a.shape[-1]), a=math.sqrt(5), generator=generator)
    b.zero_()


class LoRALinear(nn.Linear):
    """An `nn.Linear` plus a low-rank update; built from an existing Linear by `from_linear`."""

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._add_adapter(spec, init=True)

    def _add_adapter(self, spec: LoraSpec, init: bool) -> None:
        self.spec = spec
        self.scaling = spec.scaling
        device = self.weight.device
        self.lora_dropout = _dropout(spec.dropout)
        # skip_init: nn.Linear's own initialisation would draw from the global RNG.
        self.lora_A = skip_init(nn.Linear, self.in_features, spec.rank, bias=False, device=device,
                                dtype=torch.float32)
        self.lora_B = skip_init(nn.Linear, spec.rank, self.out_features, bias=False, device=device,
                                dtype=torch.float32)
        if init and device.type != "meta":
            init_pair(self.lora_A.weight, self.lora_B.weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: LoraSpec, init: bool = True) -> "LoRALinear":
        """A LoRALinear that owns `linear`'s weight and bias Parameters (shared, not copied);
        `init=False` leaves the adapters uninitialised (`peft.init.reset_lora_parameters`)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.register_parameter("bias", linear.bias)
        _share_fp8_scales(linear, module)
        module.fp8_backend = getattr(linear, "fp8_backend", None)
        module.base_kind = type(linear)  # an nn.Linear, or a family's frozen FP8 one
        module._add_adapter(spec, init)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = getattr(self, "weight_scale_inv", None)
        if getattr(self, "adapter_off", False):  # `adapters_disabled`: the base layer alone
            return linear_fp8(x, self.weight, scale, self.fp8_backend) if scale is not None \
                else F.linear(x, self.weight, self.bias)
        dtype = self.spec.compute_dtype(x.dtype if scale is not None else self.weight.dtype)
        # The scale folds into the [out, r] factor: no extra pass over the activations.
        a_rI = self.lora_A.weight.to(dtype)
        b_Or = (self.lora_B.weight * self.scaling).to(dtype)
        if (dtype == self.weight.dtype == x.dtype and self.bias is None and not self.weight.requires_grad
                and isinstance(self.lora_dropout, nn.Identity)):
            # The fast path: the base GEMM accumulates onto the update in place (one rounding,
            # no pass reading two [tokens, out] tensors), and the same in the backward.
            return lora_linear(x, self.weight, a_rI, b_Or)
        delta = F.linear(F.linear(self.lora_dropout(x.to(dtype)), a_rI), b_Or)
        if scale is not None:  # a frozen FP8 base (glmtune/models/glm5/fp8_base.py)
            out = linear_fp8(x, self.weight, scale, self.fp8_backend)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out + delta.to(out.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """s * B @ A in fp32, shaped like `weight`."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def base_module(self) -> nn.Linear:
        """The Linear it wrapped (an nn.Linear, or a family's FP8 one on an FP8 base: GLM-5's
        `Fp8Linear`) over the same Parameters (the adapter dropped, not merged)."""
        kind = getattr(self, "base_kind", nn.Linear)
        linear = kind.__new__(kind)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight = self.weight
        linear.register_parameter("bias", self.bias)
        _share_fp8_scales(self, linear)
        if getattr(self, "weight_scale_inv", None) is not None:
            linear.fp8_backend = self.fp8_backend
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.spec.rank}, scaling={self.scaling:g}"


class LoRAGroupedExperts(nn.Module):
    """A family's stacked routed experts with stacked per-expert adapters on `gate_up_proj`
    and/or `down_proj`.

    The experts module is the family's (which modules are: its spec's `lora.is_grouped_experts`;
    GLM-5's `GroupedExperts`); it keeps them stacked as `gate_up_proj` [E, 2I, D] and `down_proj`
    [E, D, I] with `num_experts`, `backend` and `project(x, proj, offsets)`, the base product of
    one projection. `from_experts` makes the module an instance of a subclass of both, made once
    per experts class (`_lora_class`, the way FSDP2 subclasses a module's class), so the family's
    own code still sees its experts class and this module adds only the adapters.

    Adapter parameters: `lora_gate_up_A` [E, r, D], `lora_gate_up_B` [E, 2I, r],
    `lora_down_A` [E, r, I], `lora_down_B` [E, D, r]; a projection that is not
    targeted has None for both.
    """

    base_kind: type[nn.Module]  # the family's experts class (`_lora_class` sets it)

    @classmethod
    def from_experts(cls, experts: nn.Module, spec: LoraSpec, targets: tuple[str, ...],
                     init: bool = True) -> "LoRAGroupedExperts":
        assert targets and set(targets) <= set(EXPERT_PARAMS), targets
        kind = _lora_class(cls, type(experts))
        module = kind.__new__(kind)
        nn.Module.__init__(module)
        module.backend = experts.backend
        module.num_experts = experts.num_experts
        module.gate_up_proj = experts.gate_up_proj
        module.down_proj = experts.down_proj
        _share_fp8_scales(experts, module)
        module._add_adapters(spec, targets, init)
        return module

    def _add_adapters(self, spec: LoraSpec, targets: tuple[str, ...], init: bool) -> None:
        """The fp32 A [E, r, in] and B [E, out, r] of each targeted stacked projection (None for the others)."""
        self.spec = spec
        self.scaling = spec.scaling
        self.targets = tuple(p for p in EXPERT_PARAMS if p in targets)
        self.lora_dropout = _dropout(spec.dropout)
        for proj in EXPERT_PARAMS:
            a_name, b_name = f"lora_{_short(proj)}_A", f"lora_{_short(proj)}_B"
            if proj not in self.targets:
                self.register_parameter(a_name, None)
                self.register_parameter(b_name, None)
                continue
            base = getattr(self, proj)  # [E, out, in]
            num_experts, out_dim, in_dim = base.shape
            a = torch.empty(num_experts, spec.rank, in_dim, device=base.device, dtype=torch.float32)
            b = torch.empty(num_experts, out_dim, spec.rank, device=base.device, dtype=torch.float32)
            if init and base.device.type != "meta":
                init_pair(a, b)
            self.register_parameter(a_name, nn.Parameter(a))
            self.register_parameter(b_name, nn.Parameter(b))

    def adapter(self, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [E, r, in], B [E, out, r]) of `proj`, or None when it is not targeted."""
        a = getattr(self, f"lora_{_short(proj)}_A")
        return None if a is None else (a, getattr(self, f"lora_{_short(proj)}_B"))

    def _lora(self, x_NX: torch.Tensor, proj: str, offsets_E: torch.Tensor) -> torch.Tensor | None:
        pair = self.adapter(proj)
        if pair is None:
            return None
        dtype = self.spec.compute_dtype(x_NX.dtype)
        a_ErX = pair[0].to(dtype)
        b_EOr = (pair[1] * self.scaling).to(dtype)  # the scale folds into the small factor
        h_Nr = grouped_linear(self.lora_dropout(x_NX.to(dtype)), a_ErX, offsets_E, self.backend)
        return grouped_linear(h_Nr, b_EOr, offsets_E, self.backend)

    def _fused(self, x_NX: torch.Tensor) -> bool:
        """Whether base and adapter products run together (`expert_lora_linear`)."""
        return (self.spec.compute_dtype(self.gate_up_proj.dtype) == self.gate_up_proj.dtype == x_NX.dtype
                and isinstance(self.lora_dropout, nn.Identity) and self.backend == "grouped_mm")

    def _project(self, x_NX: torch.Tensor, proj: str, counts_E: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """x through one stacked projection, its adapter's update included."""
        pair = self.adapter(proj)
        if pair is None or getattr(self, "adapter_off", False):
            return self.project(x_NX, proj, offsets_E)
        if self._fused(x_NX):
            b_EOr = (pair[1] * self.scaling).to(x_NX.dtype)
            return expert_lora_linear(x_NX, getattr(self, proj), pair[0].to(x_NX.dtype), b_EOr, counts_E,
                                      resolve_backend(self.spec.kernel, x_NX.device))
        out = self.project(x_NX, proj, offsets_E)
        return out + self._lora(x_NX, proj, offsets_E).to(out.dtype)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0)
        gate_up_N2I = self._project(x_ND, "gate_up_proj", tokens_per_expert_E, offsets_E)
        gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
        return self._project(F.silu(gate_NI) * up_NI, "down_proj", tokens_per_expert_E, offsets_E)

    @torch.no_grad()
    def delta_weight(self, proj: str) -> torch.Tensor:
        """s * B[e] @ A[e] for every expert, fp32, shaped like the stacked base [E, out, in]."""
        a, b = self.adapter(proj)
        return self.scaling * torch.bmm(b.float(), a.float())

    def base_module(self) -> nn.Module:
        """The family's plain experts module over the same Parameters (the adapters dropped, not merged)."""
        experts = self.base_kind.__new__(self.base_kind)
        nn.Module.__init__(experts)
        experts.backend, experts.num_experts = self.backend, self.num_experts
        experts.gate_up_proj, experts.down_proj = self.gate_up_proj, self.down_proj
        _share_fp8_scales(self, experts)
        return experts

    def extra_repr(self) -> str:
        return f"targets={self.targets}, rank={self.spec.rank}, scaling={self.scaling:g}"


class LoRAFoldedExperts(LoRAGroupedExperts):
    """Stacked experts whose forward is the family's own (transformers' experts: they take the
    router's choice and read their stacked Parameters), with the adapters of `LoRAGroupedExperts`
    folded into the weights that forward reads: per expert W + s * B[e] @ A[e], one `baddbmm` of
    the base and the factors in the compute dtype, rounded to the base's dtype. This is the update
    PEFT's `target_parameters` (lora.ParamWrapper) applies to transformers' stacked experts, so the
    same export loads there with the same outputs. The fold has no adapter input, hence no dropout
    (`apply_lora` refuses peft.dropout > 0 for such experts, as PEFT does)."""

    @classmethod
    def from_experts(cls, experts: nn.Module, spec: LoraSpec, targets: tuple[str, ...],
                     init: bool = True) -> "LoRAFoldedExperts":
        assert targets and set(targets) <= set(EXPERT_PARAMS), targets
        kind = _lora_class(cls, type(experts))
        module = _same_state(experts, kind)
        module._add_adapters(spec, targets, init)
        return module

    def folded_weight(self, proj: str) -> torch.Tensor:
        """The stacked `proj` [E, out, in] the experts' forward reads: base + s * B @ A per expert."""
        a_ErX, b_EOr = self.adapter(proj)
        base = getattr(self, proj)
        dtype = self.spec.compute_dtype(base.dtype)
        return torch.baddbmm(base.to(dtype), b_EOr.to(dtype), a_ErX.to(dtype), alpha=self.scaling).to(base.dtype)

    def forward(self, *args, **kwargs):
        if getattr(self, "adapter_off", False):  # `adapters_disabled`: the base experts alone
            return self.base_kind.forward(self, *args, **kwargs)
        folded = {proj: self.folded_weight(proj) for proj in self.targets}
        saved = {proj: self._parameters[proj] for proj in folded}
        # The experts' forward reads its Parameters by attribute: it sees the folded tensors for
        # this call (autograd reaches the adapters through them), then the Parameters are back.
        self._parameters.update(folded)
        try:
            return self.base_kind.forward(self, *args, **kwargs)
        finally:
            self._parameters.update(saved)

    def base_module(self) -> nn.Module:
        """The family's plain experts module over the same Parameters (the adapters dropped, not merged)."""
        experts = _same_state(self, self.base_kind)
        for name in [*self._parameters, "lora_dropout"]:
            if name.startswith("lora_"):
                delattr(experts, name)
        for name in ("spec", "scaling", "targets", "adapter_off"):
            experts.__dict__.pop(name, None)
        return experts


_MODULE_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _same_state(source: nn.Module, kind: type[nn.Module]) -> nn.Module:
    """A `kind` module holding `source`'s attributes, Parameters, buffers and submodules (the same
    objects, in containers of its own: what is registered on one later is not on the other), and
    none of its hooks."""
    module = kind.__new__(kind)
    nn.Module.__init__(module)
    internal = set(vars(module))
    module.__dict__.update({k: v for k, v in vars(source).items() if k not in internal})
    module.training = source.training
    for name in _MODULE_STATE:
        setattr(module, name, copy.copy(getattr(source, name)))
    return module


@functools.cache
def _lora_class(lora_kind: type[LoRAGroupedExperts], experts_kind: type[nn.Module]) -> type[LoRAGroupedExperts]:
    """`lora_kind` (`LoRAGroupedExperts` or `LoRAFoldedExperts`) over a family's experts class: the
    adapters' forward first, then the family's (its `project`, `reset_parameters`, `isinstance` checks)."""
    assert not issubclass(experts_kind, LoRAGroupedExperts), "the experts already carry adapters"
    return type(f"LoRA{experts_kind.__name__}", (lora_kind, experts_kind),
                {"base_kind": experts_kind, "__module__": LoRAGroupedExperts.__module__})


def experts_lora_class(folds: bool) -> type[LoRAGroupedExperts]:
    """The LoRA module of a family's stacked experts: folded into their weights (`LoraRules.folds_experts`)
    or on the tokens routed to each expert."""
    return LoRAFoldedExperts if folds else LoRAGroupedExperts


def _share_fp8_scales(source: nn.Module, target: nn.Module) -> None:
    """A frozen FP8 base's block scales (`<weight>_scale_inv`) go with its weights, and so does the
    backend that computes its products (`fp8_backend`, `model.fp8_base`)."""
    for name, param in source.named_parameters(recurse=False):
        if name.endswith("_scale_inv"):
            target.register_parameter(name, param)
    if getattr(source, "fp8_backend", None) is not None:
        target.fp8_backend = source.fp8_backend


def _short(proj: str) -> str:
    return {"gate_up_proj": "gate_up", "down_proj": "down"}[proj]


LORA_MODULES = (LoRALinear, LoRAGroupedExperts)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAGroupedExperts]]:
    """Every LoRA module of `model` with its name, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LORA_MODULES)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside it, every LoRA module of `model` computes its base layer alone: the model it was
    adapted from, with no second copy of the weights (a preference objective's reference model).
    An attribute, not a parameter: state dicts, FSDP2 and the adapters' gradients are untouched."""
    modules = [module for _, module in lora_modules(model)]
    for module in modules:
        module.adapter_off = True
    try:
        yield
    finally:
        for module in modules:
            module.adapter_off = False
