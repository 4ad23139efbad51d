"""The LoRA runs `make test-engines` checks the engines against: one per variant, each
`recipes/tiny/lora_support_json.yaml` trained 2 steps with these overrides. Pure data, read by
tests/engines/ in the engines venv and by the default suite (tests/peft/test_engines.py)."""

import ast
import json
from pathlib import Path

RECIPE = "recipes/tiny/lora_support_json.yaml"
# GLM-5's default LoRA targets, read from the file: the engines venv does not have glmtune installed.
_SCHEMA = Path(__file__).parents[2] / "glmtune" / "models" / "glm5" / "lora_rules.py"
DEFAULT_LORA_TARGETS = next(ast.literal_eval(n.value) for n in ast.parse(_SCHEMA.read_text()).body
                            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "DEFAULT_LORA_TARGETS")

_ATTN = ["*.self_attn.q_a_proj", "*.self_attn.q_b_proj", "*.self_attn.kv_a_proj_with_mqa", "*.self_attn.kv_b_proj",
         "*.self_attn.o_proj"]
_MLP = ["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj", "*.mlp.shared_experts.*"]
# variant -> overrides of RECIPE
VARIANTS = {
    "full": [],
    "down_only": ["--peft.target_modules", json.dumps(_ATTN + _MLP + ["*.mlp.experts.down_proj"])],
    "gate_up_only": ["--peft.target_modules", json.dumps(_ATTN + _MLP + ["*.mlp.experts.gate_up_proj"])],
    "experts_down_only": ["--peft.target_modules", json.dumps(_ATTN + ["*.mlp.experts.down_proj"])],
    "rslora": ["--peft.rslora", "true"],
    # The MTP loss on: the MTP layer (tiny: model.layers.4) takes the default targets' adapters, and
    # with "*.eh_proj" its glue Linear too (docs/lora.md, The MTP layer under LoRA).
    "mtp": ["--train.mtp_loss_weight", "0.3"],
    "mtp_eh_proj": ["--train.mtp_loss_weight", "0.3", "--peft.target_modules",
                    json.dumps(list(DEFAULT_LORA_TARGETS) + ["*.eh_proj"])],
}
# The variants SGLang serves (the others are refused for it: rsLoRA, MTP-layer adapters), whose
# commands `make test-engines` starts SGLang with (tests/engines/sglang_startup.py).
SGLANG_SERVED = ("full", "down_only", "gate_up_only", "experts_down_only")


def peft_overrides(variant: str) -> dict:
    """The variant's `peft.*` overrides as PeftConfig keyword arguments."""
    pairs = dict(zip(VARIANTS[variant][::2], VARIANTS[variant][1::2]))
    return {key.removeprefix("--peft."): json.loads(value) for key, value in pairs.items()
            if key.startswith("--peft.")}
