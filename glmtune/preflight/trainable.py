"""Check 4: what trains, counted on the meta device for the whole model the recipe names.

The model is built on the meta device by its family's spec (`glmtune.models.registry`; no
memory, the 754B configurations included) and transformed as training transforms it
(the MTP layer and the indexers unfrozen when their losses train, then `apply_lora`, or nothing
more for full fine-tuning), then inventoried by
`glmtune.peft.build_inventory`: trainable and frozen elements per group (the spec's
`param_groups`: attention, indexer, router, shared and routed experts, dense MLP, norms,
embeddings, head, MTP) and the LoRA targets behind them.

Fails when nothing trains; for LoRA when a `peft.target_modules` entry matches no module
(apply_lora's own error), when an entry's modules end up with no trainable adapter
parameter, or when a group lists LoRA targets but trains nothing; for full fine-tuning when
a group other than the indexer and MTP layers (frozen unless their losses train) is frozen.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from glmtune.config import JobConfig
from glmtune.models.registry import model_args, model_spec
from glmtune.peft import LoRAGroupedExperts, LoraInventory, apply_lora, build_inventory, lora_modules, target_globs
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.train.precision import resolve_precision

FROZEN_BY_DESIGN = {"indexer": "the DSA indexers train only with train.indexer_loss_weight > 0",
                    "mtp": "the MTP layer trains only with train.mtp_loss_weight > 0"}


def transformed_meta_model(cfg: JobConfig, args: Any = None) -> tuple[nn.Module, LoraInventory]:
    """The model `cfg` trains (or `args`, the family's architecture, e.g. a truncated one) on the
    meta device, after its LoRA transform, in the run's parameter dtype; and its inventory."""
    spec = model_spec(cfg.model)
    model = spec.weights.build(args or model_args(cfg.model), resolve_precision(cfg).param_dtype, "meta")
    if args is None:  # the recipe's model: MTP layer and indexers as training sets them (a truncated one has no MTP)
        spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    inventory = apply_lora(model, cfg.peft) if cfg.peft.method == "lora" else build_inventory(model)
    return model, inventory


def target_counts(model: nn.Module, target_modules: list[str]) -> dict[str, dict[str, int]]:
    """Per `peft.target_modules` entry: the adapted modules it selects and their trainable adapter elements."""
    out = {}
    for glob in target_modules:
        modules, trainable = 0, 0
        for name, module in lora_modules(model):
            projections = module.targets if isinstance(module, LoRAGroupedExperts) else ()
            # an expert module also answers to `...experts.gate_up_proj` / `...experts.down_proj`
            hits = [proj for proj in projections if fnmatchcase(f"{name}.{proj}", glob)]
            if not hits and not fnmatchcase(name, glob):
                continue
            modules += 1
            stems = [f"lora_{proj.removesuffix('_proj')}_" for proj in hits] or ["lora_"]
            trainable += sum(p.numel() for pname, p in module.named_parameters()
                             if p.requires_grad and any(pname.startswith(s) for s in stems))
        out[glob] = {"modules": modules, "trainable": trainable}
    return out


def inventory_problems(model: nn.Module, inventory: LoraInventory, cfg: JobConfig) -> tuple[list[str], dict[str, Any]]:
    problems, evidence = [], {"inventory": inventory.to_dict()}
    if inventory.trainable == 0:
        problems.append("nothing trains: every parameter is frozen")
    if inventory.method == "lora":
        evidence["targets"] = counts = target_counts(model, inventory.target_modules or target_globs(model, cfg.peft))
        for glob, count in counts.items():
            if count["trainable"] == 0:
                problems.append(f"peft.target_modules {glob!r} selects {count['modules']} modules but none of "
                                "their adapter parameters trains")
        for row in inventory.rows:
            if row.targets and not row.trainable:
                problems.append(f"group {row.group} has LoRA targets ({'; '.join(row.targets)}) but 0 trainable "
                                "parameters")
    else:
        for row in inventory.rows:
            if row.total and not row.trainable and row.group not in FROZEN_BY_DESIGN:
                problems.append(f"full fine-tuning leaves group {row.group} frozen ({row.total:,} parameters)")
    groups = {row.group for row in inventory.rows}  # the family's (a family without an indexer has no such group)
    evidence["frozen_by_design"] = {g: why for g, why in FROZEN_BY_DESIGN.items()
                                    if g in groups and inventory.row(g).total}
    return problems, evidence


def check_trainable(pf: Preflight, model: nn.Module | None = None, inventory: LoraInventory | None = None
                    ) -> CheckResult:
    """Check 4 on the recipe's model, or on `model` as given (transformed, with its inventory)."""
    try:
        if model is None:
            model, inventory = transformed_meta_model(pf.cfg)
    except (OSError, ValueError) as exc:  # no readable config; a target glob that matches nothing
        return CheckResult(4, "fail", str(exc), {"peft": vars(pf.cfg.peft)})
    problems, evidence = inventory_problems(model, inventory, pf.cfg)
    trains = [f"{r.group} {r.trainable:,}" for r in inventory.rows if r.trainable]
    how = (f"LoRA r={inventory.rank} on {inventory.num_adapted_modules} modules" if inventory.method == "lora"
           else "full fine-tuning")
    share = 100 * inventory.trainable / max(inventory.total, 1)
    message = (f"{how}: {inventory.trainable:,} of {inventory.total:,} parameters train ({share:.3g}%): "
               + ", ".join(trains))
    return verdict(4, problems, message, evidence)
