"""Write tests/peft/engine_fixtures/ from trained runs: `python tests/engines/capture.py RUNS_ROOT`.

RUNS_ROOT holds one glmtune run per variant (see VARIANTS); run in the engines venv."""

import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_views  # noqa: E402

# The schema's default LoRA targets, read from the file: the engines venv does not have glmtune installed.
_SCHEMA = Path(__file__).parents[2] / "glmtune" / "config" / "schema.py"
DEFAULT_LORA_TARGETS = next(ast.literal_eval(n.value) for n in ast.parse(_SCHEMA.read_text()).body
                            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "DEFAULT_LORA_TARGETS")

FIXTURES = Path(__file__).parents[1] / "peft" / "engine_fixtures"
_ATTN = ["*.self_attn.q_a_proj", "*.self_attn.q_b_proj", "*.self_attn.kv_a_proj_with_mqa", "*.self_attn.kv_b_proj",
         "*.self_attn.o_proj"]
_MLP = ["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj", "*.mlp.shared_experts.*"]
# variant -> overrides of recipes/tiny/lora_support_json.yaml (trained 2 steps)
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
LAYOUTS = {"peft": "adapter", "per_expert": "adapter_per_expert"}


def capture(runs_root: Path) -> dict[str, dict]:
    out = {}
    for variant in VARIANTS:
        run = runs_root / variant
        for layout, sub in LAYOUTS.items():
            for engine in ("vllm", "sglang"):
                out[f"{engine}-{layout}-{variant}.json"] = engine_views.fixture(engine, layout, variant, run / sub,
                                                                                run / "base")
    return out


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, data in capture(Path(sys.argv[1])).items():
        (FIXTURES / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(name)
