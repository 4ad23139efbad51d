"""`apply_lora(model, peft_cfg)`: LoRA as a transformation of a built model of a family.

Run it after the model is built (any device, meta included) and before any
parallel wrapping. It

  1. matches `peft.target_modules` (fnmatch globs; null: the family's `default_targets`)
     against module names, minus `peft.exclude_modules`; the routed experts of a layer are
     one module (`model.layers.3.mlp.experts`, both projections) and also answer to
     `...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj` alone;
  2. freezes every parameter (base weights, router, indexer, norms, embeddings,
     head, MTP);
  3. swaps each target for its LoRA version (`LoRALinear`, `LoRAGroupedExperts`),
     whose fp32 adapters are the only trainable parameters.

Globs that match nothing are errors, so a typo cannot silently train nothing on
the experts. Embeddings and lm_head cannot take LoRA: the loss reads `lm_head.weight`
directly (a wrapped head would be bypassed). What else stays frozen, and which modules are
the stacked experts, is the family's (its spec's `lora`, models/common/lora_rules.py): for
GLM-5 the router and the DSA indexer, frozen by design, and the MTP layer as below.

The MTP layer (`mtp.{j}`) runs only with the MTP loss (`train.mtp_loss_weight > 0`),
whose switch is the spec's `set_auxiliary_training`: it unfreezes the MTP layer before
`apply_lora` runs. When it has, the MTP layer's modules are targets like the decoder
layers' (the same globs select them: `*.self_attn.q_a_proj` names `mtp.0.self_attn.
q_a_proj` too; its glue Linear `eh_proj` only when a glob names it; its norms and
indexer never) and its base weights are frozen again with the rest. Otherwise they
cannot take LoRA and the adapters are those of a model without the MTP layer.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from glmtune.config.schema import PeftConfig
from glmtune.models.common.lora_rules import LoraRules
from glmtune.peft.family import spec_of
from glmtune.peft.init import reset_lora_parameters
from glmtune.peft.inventory import LoraInventory, build_inventory, module_kind
from glmtune.peft.lora import EXPERT_PARAMS, LoRALinear, LoraSpec, experts_lora_class, lora_modules

Target = tuple[str, str | None]  # (module name, expert projection or None for a Linear)


def lora_spec(peft_cfg: PeftConfig) -> LoraSpec:
    """Validated hyper-parameters; ValueError names the offending `peft.*` key."""
    if peft_cfg.method != "lora":
        raise ValueError(f"peft.method is {peft_cfg.method!r}; LoRA needs peft.method: lora")
    if not isinstance(peft_cfg.rank, int) or peft_cfg.rank < 1:
        raise ValueError(f"peft.rank must be a positive integer, got {peft_cfg.rank!r}")
    if not peft_cfg.alpha > 0:
        raise ValueError(f"peft.alpha must be > 0, got {peft_cfg.alpha!r}")
    if not 0.0 <= peft_cfg.dropout < 1.0:
        raise ValueError(f"peft.dropout must be in [0, 1), got {peft_cfg.dropout!r}")
    if peft_cfg.target_modules is not None and not peft_cfg.target_modules:
        raise ValueError("peft.target_modules is empty: nothing would train")
    return LoraSpec(peft_cfg.rank, float(peft_cfg.alpha), float(peft_cfg.dropout), bool(peft_cfg.rslora),
                    peft_cfg.adapter_compute, peft_cfg.adapter_kernel)


def mtp_trains(model: nn.Module) -> bool:
    """Whether the MTP layer runs in training: `set_auxiliary_training(mtp=True)` unfroze it
    (its indexer follows the indexer switch instead)."""
    return any(p.requires_grad for n, p in model.named_parameters() if n.startswith("mtp.") and ".indexer." not in n)


def _frozen_reason(rules: LoraRules, name: str, module: nn.Module, mtp: bool) -> str | None:
    """Why a module with weights cannot take LoRA, or None when it can (or has no weights)."""
    reason = rules.frozen_reason(name, module, mtp)
    if reason is not None:
        return reason
    if isinstance(module, nn.Embedding):
        return "embeddings take no LoRA"
    if name == "lm_head":
        return "the loss reads lm_head.weight directly, so a LoRA on it would be bypassed"
    return None


def _candidates(model: nn.Module) -> tuple[dict[str, set[Target]], dict[str, str]]:
    """Names a glob may match -> the targets they select; and frozen names -> reason."""
    candidates: dict[str, set[Target]] = {}
    frozen: dict[str, str] = {}
    mtp = mtp_trains(model)
    rules = spec_of(model).lora
    assert rules is not None
    for name, module in model.named_modules():
        experts = rules.is_grouped_experts(module)
        unadaptable = rules.unadaptable_experts_reason(module)
        if unadaptable is not None:
            frozen[name] = unadaptable
            continue
        if not (experts or isinstance(module, (nn.Linear, nn.Embedding, *rules.frozen_kinds))):
            continue
        reason = _frozen_reason(rules, name, module, mtp)
        if reason is not None:
            frozen[name] = reason
        elif experts:
            candidates[name] = {(name, p) for p in EXPERT_PARAMS}
            for proj in EXPERT_PARAMS:
                candidates[f"{name}.{proj}"] = {(name, proj)}
        elif isinstance(module, nn.Linear):
            candidates[name] = {(name, None)}
    return candidates, frozen


def _no_match_error(key: str, glob: str, candidates: dict[str, set[Target]], frozen: dict[str, str]) -> ValueError:
    blocked = [n for n in frozen if fnmatchcase(n, glob)]
    if blocked:
        detail = f"it matches only {blocked[0]}" + (f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else "")
        detail += f", which cannot take LoRA: {frozen[blocked[0]]}"
    else:
        kinds = sorted({module_kind(n) for n in candidates})
        detail = "targetable modules: " + ", ".join(kinds)
    return ValueError(f"{key}: {glob!r} matches no module; {detail}")


def target_globs(model: nn.Module, peft_cfg: PeftConfig) -> list[str]:
    """`peft.target_modules`, or the family's default targets for `model` (plain, or as `apply_lora`
    transformed it) when it is null."""
    if peft_cfg.target_modules is not None:
        return list(peft_cfg.target_modules)
    return list(spec_of(model).lora.default_targets(model))


def select_targets(model: nn.Module, peft_cfg: PeftConfig, globs: list[str] | None = None
                   ) -> dict[str, tuple[str, ...] | None]:
    """Module name -> None (a Linear) or the expert projections to adapt, in module order; `globs`:
    the target globs (None: `target_globs` of the plain model)."""
    candidates, frozen = _candidates(model)
    selected: set[Target] = set()
    for glob in target_globs(model, peft_cfg) if globs is None else globs:
        hits = [t for name, targets in candidates.items() if fnmatchcase(name, glob) for t in targets]
        if not hits:
            raise _no_match_error("peft.target_modules", glob, candidates, frozen)
        selected.update(hits)
    for glob in peft_cfg.exclude_modules:
        hits = {t for name, targets in candidates.items() if fnmatchcase(name, glob) for t in targets}
        if not hits & selected:
            raise ValueError(f"peft.exclude_modules: {glob!r} matches none of the targeted modules")
        selected -= hits
    if not selected:
        raise ValueError("peft.exclude_modules removes every module peft.target_modules selects")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    out: dict[str, tuple[str, ...] | None] = {}
    for name, proj in sorted(selected, key=lambda t: (order[t[0]], t[1] or "")):
        if proj is None:
            out[name] = None
        else:
            out[name] = tuple(p for p in EXPERT_PARAMS if (name, p) in selected)
    return out


def apply_lora(model: nn.Module, peft_cfg: PeftConfig, seed: int | None = None) -> LoraInventory:
    """Freeze `model` and add LoRA adapters on the modules `peft_cfg` targets, in place.

    Args:
        model: a built GLM-5 model, not yet wrapped for parallelism; with the MTP loss,
            after `set_auxiliary_training(mtp=True)` (its MTP layer is then adapted too).
        peft_cfg: the `peft` section; `method` must be `lora`.
        seed: seeds the adapters' A initialisation (the global RNG is left untouched);
            None draws from the global CPU RNG. A model on the meta device gets
            uninitialised adapters: call `reset_lora_parameters(model, seed)` once it is
            materialized (same values as here).

    Returns:
        The trainable-parameter inventory of the transformed model.
    """
    spec = lora_spec(peft_cfg)
    if lora_modules(model):
        raise ValueError("the model already carries LoRA adapters; apply_lora runs once per model")
    globs = target_globs(model, peft_cfg)
    targets = select_targets(model, peft_cfg, globs)
    folds = spec_of(model).lora.folds_experts
    _check_folded_dropout(targets, spec, folds)
    for param in model.parameters():
        param.requires_grad_(False)
    for name, projs in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if projs is None:
            new = LoRALinear.from_linear(module, spec, init=False)
        else:
            new = experts_lora_class(folds).from_experts(module, spec, projs, init=False)
        setattr(parent, child, new)
    if not any(p.is_meta for p in model.parameters()):
        reset_lora_parameters(model, seed)  # on meta: after materializing (load_sharded's caller)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable[:5]
    inventory = build_inventory(model)
    inventory.target_modules = globs  # the run's record: the globs actually used
    inventory.exclude_modules = list(peft_cfg.exclude_modules)
    return inventory


def _check_folded_dropout(targets: dict[str, tuple[str, ...] | None], spec: LoraSpec, folds: bool) -> None:
    """Experts whose adapters fold into their weights (`LoRAFoldedExperts`) see no adapter input to drop."""
    experts = [name for name, projs in targets.items() if projs is not None]
    if folds and experts and spec.dropout > 0:
        raise ValueError(f"peft.dropout: {spec.dropout:g} cannot apply to {experts[0]}: this family's stacked "
                         "experts take LoRA as an update of their weights (as PEFT's target_parameters do), which "
                         "has no adapter input to drop out; set peft.dropout: 0 or exclude the experts "
                         "(peft.exclude_modules)")
