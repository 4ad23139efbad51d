"""Parameter-efficient fine-tuning as transformations of a built model of any family.

    from glmtune.peft import apply_lora, export_run_adapters, merge_lora
    inventory = apply_lora(model, cfg.peft)          # freeze + adapters, before parallel wrapping
    print_inventory(inventory)                       # what trains, by group
    export_run_adapters(model, run_dir)              # RUN_DIR/adapter (PEFT), RUN_DIR/adapter_per_expert (engines)
"""

from glmtune.peft.apply import apply_lora, lora_spec, select_targets, target_globs
from glmtune.peft.adapter_export import LAYOUTS, adapter_state, export_adapter, export_run_adapters
from glmtune.peft.inventory import LoraInventory, build_inventory, print_inventory
from glmtune.peft.lora import LoRAGroupedExperts, LoRALinear, LoraSpec, lora_modules
from glmtune.peft.merge import merge_adapter_dir, merge_lora, merge_to_dir

__all__ = [
    "apply_lora", "lora_spec", "select_targets", "target_globs", "LAYOUTS", "adapter_state", "export_adapter",
    "export_run_adapters", "LoraInventory", "build_inventory", "print_inventory", "LoRAGroupedExperts",
    "LoRALinear", "LoraSpec", "lora_modules", "merge_adapter_dir", "merge_lora", "merge_to_dir",
]
