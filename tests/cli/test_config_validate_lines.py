"""What `glmtune config validate` prints about the pipeline and the schedule (issue 49): a recipe
without a pipeline is "pp 1 (one stage of 78 layers)", not "pp stages 78", and the schedule line
gives the warm-up in steps and where it came from (optim.warmup_ratio or optim.warmup_steps)."""

from __future__ import annotations

from glmtune.cli import main
from glmtune.config import RECIPES_DIR

LORA_1NODE = str(RECIPES_DIR / "glm5" / "lora_fp8_1node.yaml")


def test_one_stage_is_named_as_one_stage(capsys):
    assert main(["config", "validate", LORA_1NODE]) == 0
    out = capsys.readouterr().out
    assert "78 layers, pp 1 (one stage of 78 layers) [" in out and "pp stages 78" not in out, out


def test_a_pipeline_still_lists_its_stages(capsys):
    assert main(["config", "validate", str(RECIPES_DIR / "glm5" / "sft_4k.yaml")]) == 0
    assert "78 layers, pp stages 36 stages of 1-3 layers [" in capsys.readouterr().out


def test_the_schedule_line_names_the_warm_up_and_its_source(capsys):
    assert main(["config", "validate", "tiny/sft_support_json"]) == 0
    assert "    schedule: 300 steps, warm-up 20 (optim.warmup_ratio 0.065 x 300, rounded up), then cosine to 0.1 x lr" \
        in capsys.readouterr().out
    assert main(["config", "validate", "tiny/sft_support_json", "--train.max_steps", "10",
                 "--optim.warmup_steps", "3"]) == 0
    assert "schedule: 10 steps, warm-up 3 (optim.warmup_steps, which takes precedence over optim.warmup_ratio " \
        "0.065)" in capsys.readouterr().out
