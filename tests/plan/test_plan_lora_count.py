"""`glmtune plan` of a LoRA recipe counts the model as the model (issue 49): GLM-5's 753.86B parameters
(the closed-form count, MTP layer included), not the model plus its adapters and an FP8 base's block
scales; the adapters on a line of their own; the floor's bf16 weights from the model's count."""

from __future__ import annotations

import json

from rich.console import Console

from glmtune.cli import main
from glmtune.config import RECIPES_DIR
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.param_count import parameter_count
from glmtune.plan.plan_report import print_report


def test_lora_fp8_recipe_counts_the_model_and_lists_adapters_apart(capsys):
    recipe = str(RECIPES_DIR / "glm5" / "lora_fp8_1node.yaml")
    assert main(["plan", recipe, "--no-data", "--gpu", "h200-141g", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    glm5 = parameter_count(get_preset("glm5"))
    assert glm5 == 753_864_119_552
    assert report["model"] == f"glm5: {glm5:,} parameters, LoRA r=16"
    assert report["floor"][0] == {"what": "bf16 weights", "bytes": 2 * glm5, "note": f"{glm5:,} parameters x 2 B"}
    adapters = [row for row in report["floor"] if row["what"] == "LoRA on a bf16 base"][0]
    count = int(report["adapters"].split(": ")[1].split(" ")[0].replace(",", ""))
    assert adapters["bytes"] == 2 * glm5 + 16 * count and count > 0
    console = Console(width=200, record=True)
    print_report(report, console)
    lines = console.export_text().splitlines()
    assert lines[0] == f"{recipe}: glm5: {glm5:,} parameters, LoRA r=16"
    assert lines[1] == f"LoRA r=16 adapters: {count:,} parameters (trained; not among the model's)"
