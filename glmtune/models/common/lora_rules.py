"""`LoraRules`: what `glmtune.peft` needs to know of a family's modules beyond its spec's answers.

peft/ adapts, exports, merges and describes a family's linear layers by the same glob rules for
every family; the parameter groups and the HF names come from the family's spec (`param_group`,
`state_dict_adapter`). What only the architecture knows is here, behind this interface (its
spec's `lora`): whether a built model is the family's, the modules `peft.target_modules` means
when the recipe leaves it unset (`default_targets`), which of its modules are stacked routed
experts (adapted as one module by peft/lora.py's `LoRAGroupedExperts`, on the tokens routed to
each expert or, for experts whose forward the family does not own, `folded` into their weights
as PEFT's `target_parameters` does) and which modules never take LoRA and why, the names an
adapter file gives the modules when they are not the state-dict adapter's, the MLP leaves PEFT
moves from `target_modules` to `target_parameters` on load, and the parts the serving engines'
facts (peft/engines.py) are about: the attention projections an MLA engine never applies a delta
to, and the multi-token-prediction layers an engine drafts with. GLM-5's is
`glmtune/models/glm5/lora_rules.py`, the hf family's `glmtune/models/hf/lora_rules.py`.

Knows no family: the methods take the family's own model and return its own modules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: `glmtune --help` imports model_spec.py, which imports this
    from torch import nn


class LoraRules(ABC):
    """One family's LoRA hooks (module docstring). Stateless: one instance per family."""

    # the family's module kinds with weights, neither Linear nor stacked experts, that take no
    # LoRA (GLM-5's router): a glob naming one is told why (`frozen_reason`)
    frozen_kinds: tuple[type, ...] = ()
    # How the stacked experts' adapters compute: False, on the tokens routed to each expert
    # (`LoRAGroupedExperts`: the family's experts have `project`, below); True, folded into the
    # stacked weights for the experts' own forward (W + s * B @ A per expert, the update PEFT's
    # `target_parameters` applies: `LoRAFoldedExperts`), which has no input dropout.
    folds_experts: bool = False

    @abstractmethod
    def owns(self, model: nn.Module) -> bool:
        """Whether `model` is this family's causal LM (sharded or not)."""

    @abstractmethod
    def default_targets(self, model: nn.Module) -> tuple[str, ...]:
        """The `peft.target_modules` globs a recipe that leaves them unset (null) trains on `model`."""

    def is_grouped_experts(self, module: nn.Module) -> bool:
        """Whether `module` holds a layer's routed experts stacked: `gate_up_proj` [E, 2I, D] and
        `down_proj` [E, D, I] Parameters, `num_experts`, `backend` and `project(x, proj, offsets)`
        (the base product of one projection over expert-sorted tokens; with `folds_experts`, the
        two Parameters and `num_experts` alone, read by the experts' own forward); none for a
        dense family."""
        return False

    def unadaptable_experts_reason(self, module: nn.Module) -> str | None:
        """Why `module`, stacked routed experts that are not `is_grouped_experts`, takes no LoRA (a
        layout the expert adapters and their export do not cover); None for any other module."""
        return None

    def frozen_reason(self, name: str, module: nn.Module, mtp_trains: bool) -> str | None:
        """Why module `name` (one with weights: a Linear, the stacked experts, a router) stays frozen
        and takes no LoRA, or None when it can; `mtp_trains`: the multi-token-prediction loss is on."""
        return None

    def adapter_names(self, model: nn.Module) -> tuple[Callable[[str], str], Callable[[str], str]] | None:
        """(module name -> its name in an adapter file, and back) when they are not the family's
        state-dict adapter's `hf_prefix` / `internal_prefix` (None: they are)."""
        return None

    def peft_remapped_leaves(self, model: nn.Module) -> frozenset[str]:
        """The Linear leaf names PEFT (0.21, transformers 5) rewrites from an adapter's
        `target_modules` to the fused expert parameters on load for this architecture: an adapted
        Linear of such a name is listed under `target_parameters` (`<module>.weight`) instead."""
        return frozenset()

    def absorbed_projections(self, model: nn.Module) -> list[nn.Module]:
        """The attention projections an engine folding them into its attention kernel (vLLM's MLA:
        `kv_b_proj`) never applies an adapter's delta to; none for a family without them."""
        return []

    def mtp_layers(self, model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
        """(name, layer, its input projection `eh_proj`) of each multi-token-prediction layer; none
        for a family without them."""
        return []
