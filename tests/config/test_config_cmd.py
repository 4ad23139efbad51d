"""`glmtune config show|validate` through the real entry point."""

from __future__ import annotations

import pytest
import yaml

from glmtune.cli import main
from glmtune.config import RECIPES_DIR, config_from_dict, load_config

TINY = str(RECIPES_DIR / "tiny" / "sft_support_json.yaml")


def test_show_prints_resolved_yaml_with_overrides(capsys):
    assert main(["config", "show", TINY, "--optim.lr=3e-4", "--train.max_steps", "20"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 3e-4 and printed["train"]["max_steps"] == 20
    assert config_from_dict(printed) == load_config(TINY, ["--optim.lr=3e-4", "--train.max_steps=20"])


def test_show_accepts_a_recipe_name():
    assert main(["config", "show", "tiny/lora_support_json"]) == 0


def test_show_reports_user_errors_without_traceback(capsys):
    assert main(["config", "show", TINY, "--optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmtune config: error:") and "did you mean 'optim.lr'" in err


def test_validate_many_recipes_and_world_size(capsys):
    glm = str(RECIPES_DIR / "glm5" / "sft_4k.yaml")
    assert main(["config", "validate", TINY, glm]) == 0
    out = capsys.readouterr().out
    assert "ok   " + glm in out and "world 256 = dp_replicate 1 x dp_shard 64" in out
    # --world-size after the recipes is still the option, not an override.
    argv = ["config", "validate", glm, "--world-size", "512", "--parallel.nodes=64", "--train.global_batch_size=512"]
    assert main(argv) == 0
    assert "world 512" in capsys.readouterr().out


def test_validate_fails_with_named_keys(capsys):
    glm = str(RECIPES_DIR / "glm5" / "sft_4k.yaml")
    assert main(["config", "validate", glm, "--parallel.ep=48"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "parallel.ep (48) must divide the model's 256 routed experts" in out


@pytest.mark.parametrize("argv", [["config", "--help"], ["config", "show", "--help"], ["config", "validate", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: glmtune config" in capsys.readouterr().out


def test_bare_config_prints_help(capsys):
    assert main(["config"]) == 0
    assert "show" in capsys.readouterr().out


def test_a_recipe_that_is_not_utf8_is_named_by_line(tmp_path, capsys):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("name: demo\ndescription: caf\xe9\n".encode("latin-1"))
    assert main(["config", "show", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err == f"glmtune config: error: {recipe}:2: byte 0xe9 at column 17 is not UTF-8; save the recipe as UTF-8\n"
