"""An exported LoRA adapter applied *unmerged*: LoRA modules on the base, the adapter's weights in them.

`glmtune eval --merged` scores an adapter both ways, because serving engines run adapters
unmerged (base GEMM + low-rank update, often in another precision) while a merged checkpoint
folds the update into the base weights once (`glmtune.peft.merge`): the two can differ, and a
release should know by how much. This module builds the unmerged form from either export
layout (`glmtune.peft.adapter_export`): the LoRA modules of `glmtune.peft.lora` (the ones training
ran) around the base's own parameters, with A and B copied from the file.

PEFT layout: Linear stems map one to one; the fused expert keys are un-reshaped
(A [E*r, in] -> [E, r, in]; B [out, r*E] with column k*E + e -> [E, out, r]). Per-expert layout:
each expert's gate_proj and up_proj must share one A (glmtune's export writes it so, and the
fused [gate; up] adapter needs it), their Bs stack as [gate; up]. An MTP layer's keys
(`model.layers.{L + j}.*`) land on its in-memory modules (`mtp.{j}.*`, the state-dict adapter's
names).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from glmtune.peft.family import internal_prefix, spec_of
from glmtune.peft.init import set_whole_value
from glmtune.peft.lora import LoRALinear, LoraSpec, experts_lora_class, lora_modules
from glmtune.peft.merge import FUSED_EXPERTS_RE, PER_EXPERT_RE, fused_expert_proj, lora_pairs, read_adapter


def _spec(config: dict) -> LoraSpec:
    rank = int(config["r"])
    return LoraSpec(rank, float(config["lora_alpha"]), 0.0, bool(config.get("use_rslora")))


def _stack_per_expert(adapter_dir: Path, name: str, leaves: dict, num_experts: int) -> dict[str, tuple]:
    """{"gate_up_proj": (A [E,r,D], B [E,2I,r]), "down_proj": (...)} from per-expert pairs."""
    out = {}
    for leaf, pairs in leaves.items():
        if sorted(pairs) != list(range(num_experts)):
            raise ValueError(f"{adapter_dir}: {name} has adapters for {len(pairs)} of {num_experts} {leaf} experts")
    if "down_proj" in leaves:
        down = leaves["down_proj"]
        out["down_proj"] = (torch.stack([down[e][0] for e in range(num_experts)]),
                            torch.stack([down[e][1] for e in range(num_experts)]))
    if "gate_proj" in leaves or "up_proj" in leaves:
        if not ("gate_proj" in leaves and "up_proj" in leaves):
            raise ValueError(f"{adapter_dir}: {name} adapts only one of gate_proj and up_proj; glmtune's expert "
                             "adapter covers the fused [gate; up] projection")
        gate, up = leaves["gate_proj"], leaves["up_proj"]
        for e in range(num_experts):
            if not torch.equal(gate[e][0], up[e][0]):
                raise ValueError(f"{adapter_dir}: {name}.{e}: gate_proj and up_proj have different lora_A; "
                                 "glmtune's fused [gate; up] expert adapter needs one shared A")
        out["gate_up_proj"] = (torch.stack([gate[e][0] for e in range(num_experts)]),
                               torch.stack([torch.cat([gate[e][1], up[e][1]]) for e in range(num_experts)]))
    return out


@dataclass
class AppliedAdapter:
    modules: int  # modules adapted
    deferred: dict[str, torch.Tensor]  # parameter name -> the adapter's whole value, for a meta-device model

    def load_into(self, model: nn.Module) -> None:
        """Copy the deferred values into `model` after it was materialized (sharded: each rank its part)."""
        for name, value in self.deferred.items():
            set_whole_value(model.get_parameter(name), value)


@torch.no_grad()
def apply_adapter(model: nn.Module, adapter_dir: str | Path) -> AppliedAdapter:
    """Wrap the modules the adapter names in LoRA modules holding its weights (frozen).
    ValueError for a tensor that does not fit the model. On the meta device (a model to be
    parallelized, then loaded sharded) the weights are kept in `AppliedAdapter.deferred`."""
    adapter_dir = Path(adapter_dir)
    config, tensors = read_adapter(adapter_dir)
    if lora_modules(model):
        raise ValueError("apply_adapter needs a plain model; this one already carries LoRA adapters")
    spec = _spec(config)
    internal = internal_prefix(model)
    rules = spec_of(model).lora
    assert rules is not None
    linears: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    per_expert: dict[str, dict[str, dict[int, tuple]]] = defaultdict(lambda: defaultdict(dict))
    for stem, pair in lora_pairs(adapter_dir, tensors).items():
        a, b = pair["A"], pair["B"]
        per, fused = PER_EXPERT_RE.match(stem), FUSED_EXPERTS_RE.match(stem)
        try:  # get_submodule; the reshape of a fused pair whose rows are not E x rank
            module = model.get_submodule(internal(fused.group(1))) if fused else None
            if per:
                per_expert[internal(per.group(1))][per.group(3)][int(per.group(2))] = (a, b)
            elif module is not None and rules.is_grouped_experts(module):
                num = module.num_experts
                proj = fused_expert_proj(fused.group(1), bool(fused.group(2)), config)
                experts[internal(fused.group(1))][proj] = (
                    a.reshape(num, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num).permute(2, 0, 1).contiguous())
            else:
                linears[internal(stem)] = (a, b)
        except (AttributeError, RuntimeError) as exc:
            raise ValueError(f"{adapter_dir}: adapter module {stem} does not fit this model: {exc}") from None
    for name, leaves in per_expert.items():
        try:  # get_submodule; stacking experts' factors of different shapes
            experts[name].update(_stack_per_expert(adapter_dir, name, leaves, model.get_submodule(name).num_experts))
        except (AttributeError, RuntimeError) as exc:
            raise ValueError(f"{adapter_dir}: adapter module {name} does not fit this model: {exc}") from None
    for param in model.parameters():
        param.requires_grad_(False)
    deferred: dict[str, torch.Tensor] = {}
    for name, (a, b) in linears.items():
        _replace(model, name, adapter_dir, lambda m: LoRALinear.from_linear(m, spec, init=False),
                 lambda m: isinstance(m, nn.Linear), "Linear", {"lora_A.weight": a, "lora_B.weight": b}, deferred)
    for name, projs in experts.items():
        loads = {}
        for proj, (a, b) in projs.items():
            short = "gate_up" if proj == "gate_up_proj" else "down"
            loads.update({f"lora_{short}_A": a, f"lora_{short}_B": b})
        _replace(model, name, adapter_dir,
                 lambda m, t=tuple(projs): experts_lora_class(rules.folds_experts).from_experts(m, spec, t, init=False),
                 rules.is_grouped_experts, "GroupedExperts", loads, deferred)
    for _, module in lora_modules(model):
        module.requires_grad_(False)
    return AppliedAdapter(len(linears) + len(experts), deferred)


def _replace(model: nn.Module, name: str, adapter_dir: Path, make, fits: Callable[[nn.Module], bool], kind: str,
             loads: dict[str, torch.Tensor], deferred: dict[str, torch.Tensor]) -> None:
    """Swap module `name` (a `kind`: `fits` says) for `make(module)` after copying `loads` (parameter
    name -> value) into it (into `deferred` under its full name when the module is on the meta device)."""
    try:
        module = model.get_submodule(name)
    except AttributeError as exc:
        raise ValueError(f"{adapter_dir}: adapter module {name} does not fit this model: {exc}") from None
    if not fits(module):
        raise ValueError(f"{adapter_dir}: adapter module {name} is a {type(module).__name__} here, "
                         f"not a {kind}")
    new = make(module)
    for param_name, value in loads.items():
        param = new.get_parameter(param_name)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"{adapter_dir}: adapter module {name} has a factor of shape {tuple(value.shape)}, "
                             f"the model needs {tuple(param.shape)}")
        if param.is_meta:
            deferred[f"{name}.{param_name}"] = value
        else:
            param.copy_(value)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
