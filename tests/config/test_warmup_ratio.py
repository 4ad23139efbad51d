"""Warm-up as a fraction of the run (`optim.warmup_ratio`, issue 49): a smoke test shorter than a
recipe's warm-up (`--train.max_steps 10`) validates and warms up in proportion, the bundled recipes
keep their warm-up in steps at their own length (so their per-step losses stay bit-identical:
tests/test_golden_losses.py), and a warm-up the user sets in steps is used as given, never clamped."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.config import RECIPES_DIR, load_config, validate_config
from glmtune.config.schema import OptimConfig
from glmtune.models.catalog import model_dims

TRAINING_RECIPES = sorted(p for p in RECIPES_DIR.glob("*/*.yaml") if not p.name.startswith("eval_"))
README = RECIPES_DIR.parent / "README.md"


def _validate(recipe: str | Path, overrides: list[str], world_size: int | None = None) -> None:
    cfg = load_config(recipe, overrides)
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size, model_refusals=dims.refusals)


@pytest.mark.parametrize("path", TRAINING_RECIPES, ids=lambda p: str(p.relative_to(RECIPES_DIR)))
def test_ten_steps_of_any_bundled_recipe_validates(path: Path):
    _validate(path, ["--train.max_steps", "10"])
    cfg = load_config(path, ["--train.max_steps", "10"])
    assert 0 <= cfg.optim.warmup_steps_for(10) <= 10


@pytest.mark.parametrize("name, steps, warmup, warmup_of_10", [
    ("tiny/sft_support_json", 300, 20, 1), ("tiny/lora_support_json", 150, 20, 2), ("tiny/dpo_support_json", 60, 5, 1),
    ("tiny/distill_support_json", 300, 20, 1), ("glm5.2/distill_to_glm5_small", 20000, 500, 1),
])
def test_bundled_tiny_recipes_keep_their_warm_up_at_their_own_length(name, steps, warmup, warmup_of_10):
    cfg = load_config(name)  # the warm-up in steps each recipe stated before it stated a ratio
    assert cfg.train.max_steps == steps and cfg.optim.warmup_steps_for(steps) == warmup
    assert load_config(name, ["--train.max_steps", "10"]).optim.warmup_steps_for(10) == warmup_of_10


def test_ratio_rounds_up_as_transformers_does_and_steps_take_precedence():
    assert OptimConfig(warmup_ratio=0.1).warmup_steps_for(25) == 3  # ceil(2.5)
    assert OptimConfig(warmup_ratio=0.0).warmup_steps_for(25) == 0
    assert OptimConfig(warmup_steps=7, warmup_ratio=0.5).warmup_steps_for(100) == 7
    assert OptimConfig().warmup_steps_for(100) == 0


def test_a_warm_up_the_user_sets_in_steps_is_never_clamped():
    cfg = load_config("tiny/sft_support_json", ["--train.max_steps", "10", "--optim.warmup_steps", "4"])
    assert cfg.optim.warmup_steps_for(10) == 4
    with pytest.raises(ValueError, match=r"optim.warmup_steps \(20\) must be between 0 and train.max_steps \(10\)"):
        _validate("tiny/sft_support_json", ["--train.max_steps", "10", "--optim.warmup_steps", "20"])
    with pytest.raises(ValueError, match=r"optim.warmup_ratio must be in \[0, 1\]"):
        _validate("tiny/sft_support_json", ["--optim.warmup_ratio", "1.5"])


def _readme_train_commands() -> list[list[str]]:
    """Every `glmtune train recipes/...` command in the README's code blocks, as argv after `train`."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("glmtune train recipes/"):
                commands.append(shlex.split(line)[2:])
    return commands


@pytest.mark.parametrize("argv", _readme_train_commands(), ids=lambda argv: " ".join(argv))
def test_each_readme_train_command_validates(argv, capsys):
    """The README's train commands, the smoke test among them, pass `glmtune config validate` as printed."""
    recipe, rest = argv[0], argv[1:]
    world = []
    if "--nproc-per-node" in rest:
        at = rest.index("--nproc-per-node")
        world = ["--world-size", rest[at + 1]]
        rest = rest[:at] + rest[at + 2:]
    rest = [token for token in rest if token != "--overwrite"]
    assert main(["config", "validate", recipe, *rest, *world]) == 0, capsys.readouterr().out


def test_the_readme_has_a_smoke_test_shorter_than_the_old_warm_up():
    assert any("--train.max_steps" in argv and int(argv[argv.index("--train.max_steps") + 1]) < 20
               for argv in _readme_train_commands())
