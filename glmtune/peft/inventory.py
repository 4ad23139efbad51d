"""What trains: the trainable-parameter inventory, grouped by path, with counts.

`build_inventory(model)` works for any model of a family, LoRA or full fine-tuning, so
every run can log it at start and `glmtune inspect --trainable RECIPE.yaml` can
print it without training: a recipe that targets the routed experts but leaves
them frozen shows `routed_experts  0` here instead of failing silently.

Groups are the family's (its spec's `param_groups`; GLM-5's: attention, indexer, router,
shared_experts, routed_experts, dense_mlp, norms, embeddings, head, mtp). For each
group the inventory lists trainable and frozen element counts and which LoRA
targets live there, with layer indices folded (`self_attn.q_a_proj (x4)`: four
layers).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from torch import nn

from glmtune.peft.family import spec_of
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear, lora_modules

_INDEX_RE = re.compile(r"\.\d+(?=\.|$)")


def module_kind(name: str) -> str:
    """`model.layers.3.self_attn.q_a_proj` -> `model.layers.*.self_attn.q_a_proj`."""
    return _INDEX_RE.sub(".*", name)


@dataclass
class GroupRow:
    group: str
    trainable: int
    total: int
    targets: list[str] = field(default_factory=list)  # "kind (xN)" per LoRA target kind in this group

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


@dataclass
class LoraInventory:
    """Trainable vs frozen parameters per group, and the LoRA targets behind them."""

    method: str  # "lora" when the model carries adapters, else "full"
    rows: list[GroupRow]
    rank: int | None = None
    scaling: float | None = None
    num_adapted_modules: int = 0
    # the `peft.target_modules` globs `apply_lora` used (the family's default when the recipe's are null)
    # and `peft.exclude_modules`: the run's record of what was asked for (None: not set by `apply_lora`)
    target_modules: list[str] | None = None
    exclude_modules: list[str] | None = None

    @property
    def trainable(self) -> int:
        return sum(row.trainable for row in self.rows)

    @property
    def total(self) -> int:
        return sum(row.total for row in self.rows)

    def trainable_by_group(self) -> dict[str, int]:
        return {row.group: row.trainable for row in self.rows}

    def row(self, group: str) -> GroupRow:
        return next(r for r in self.rows if r.group == group)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "method": self.method, "rank": self.rank, "scaling": self.scaling,
            "num_adapted_modules": self.num_adapted_modules, "trainable": self.trainable, "total": self.total,
            "groups": {r.group: {"trainable": r.trainable, "frozen": r.frozen, "targets": r.targets}
                       for r in self.rows},
        }
        if self.target_modules is not None:
            out["target_modules"], out["exclude_modules"] = self.target_modules, self.exclude_modules
        return out

    def table(self) -> Table:
        title = "Trainable parameters"
        if self.method == "lora":
            title += f" (LoRA r={self.rank}, scale {self.scaling:g}, {self.num_adapted_modules} adapted modules)"
        else:
            title += " (full fine-tuning)"
        table = Table(title=title, title_justify="left")
        table.add_column("group")
        table.add_column("trainable", justify="right")
        table.add_column("frozen", justify="right")
        table.add_column("what trains (LoRA targets, x layers)", overflow="fold")
        for row in self.rows:
            if row.total == 0:
                continue
            style = None if row.trainable else "dim"
            table.add_row(row.group, f"{row.trainable:,}", f"{row.frozen:,}", "\n".join(self._what(row)),
                          style=style)
        share = 100 * self.trainable / max(self.total, 1)
        table.caption = f"{self.trainable:,} of {self.total:,} parameters train ({share:.3f}%)"
        if self.target_modules is not None:
            table.caption += f"\npeft.target_modules: {', '.join(self.target_modules)}"
        return table

    def lines(self) -> list[str]:
        """The table as plain text lines (for log files)."""
        out = [f"trainable parameters: {self.trainable:,} of {self.total:,} ({self.method})"]
        if self.target_modules is not None:
            out.append(f"  peft.target_modules: {', '.join(self.target_modules)}")
        for row in self.rows:
            if row.total:
                out.append(f"  {row.group:<15} trainable {row.trainable:>14,}  frozen {row.frozen:>16,}  "
                           + "; ".join(self._what(row)))
        return out

    def _what(self, row: GroupRow) -> list[str]:
        if row.targets:
            return row.targets
        if row.trainable:
            return ["full weights"]
        return ["frozen"]


def print_inventory(inventory: LoraInventory, console: Console | None = None) -> None:
    (console or Console(highlight=False)).print(inventory.table())


def _target_label(name: str, module: nn.Module) -> str:
    label = module_kind(name).removeprefix("model.layers.*.").removeprefix("mtp.*.")  # the group says which
    if isinstance(module, LoRAGroupedExperts):
        return f"{label}.{'+'.join(module.targets)}, {module.num_experts} experts"
    return label


def _count_by_group(model: nn.Module, groups: tuple[str, ...], param_group, trainable_only: bool = False
                    ) -> dict[str, int]:
    """Parameter elements per group, every group present (zeros included); a tied parameter once,
    under the first name `named_parameters` gives (the embedding when lm_head is tied to it)."""
    counts = dict.fromkeys(groups, 0)
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        counts[param_group(name)] += param.numel()
    return counts


def build_inventory(model: nn.Module) -> LoraInventory:
    """The inventory of `model` as it stands (after `apply_lora`, or as built for full FT)."""
    spec = spec_of(model)
    param_group, groups = spec.architecture.param_group, spec.architecture.param_groups
    total = _count_by_group(model, groups, param_group)
    trainable = _count_by_group(model, groups, param_group, trainable_only=True)
    adapted = lora_modules(model)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, module in adapted:
        base = "gate_up_proj" if isinstance(module, LoRAGroupedExperts) else "weight"
        counts[param_group(f"{name}.{base}")][_target_label(name, module)] += 1
    rows = [GroupRow(g, trainable[g], total[g], [f"{kind} (x{n})" for kind, n in counts[g].items()])
            for g in groups]
    if not adapted:
        return LoraInventory("full", rows)
    spec = adapted[0][1].spec
    assert all(m.spec == spec for _, m in adapted), "one LoRA spec per model"
    assert all(isinstance(m, (LoRALinear, LoRAGroupedExperts)) for _, m in adapted)
    return LoraInventory("lora", rows, spec.rank, spec.scaling, len(adapted))
