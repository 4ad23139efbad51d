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
    glm = str(RECIPES_DIR / "glm5" / "lora_4k.yaml")
    assert main(["config", "validate", TINY, glm]) == 0
    out = capsys.readouterr().out
    assert "ok   " + glm in out and "world 128 = dp_replicate 1 x dp_shard 128" in out
    # --world-size after the recipes is still the option, not an override.
    argv = ["config", "validate", glm, "--world-size", "256", "--parallel.nodes=32", "--train.global_batch_size=256"]
    assert main(argv) == 0
    assert "world 256 = dp_replicate 1 x dp_shard 256" in capsys.readouterr().out


def test_validate_accepts_save_at_end_and_refuses_a_non_bool(capsys):
    assert main(["config", "validate", TINY, "--checkpoint.every_steps=0", "--checkpoint.save_at_end=false"]) == 0
    assert "ok   " + TINY in capsys.readouterr().out
    assert main(["config", "show", TINY, "--checkpoint.save_at_end=sometimes"]) == 2
    assert "checkpoint.save_at_end: expected bool" in capsys.readouterr().err


def test_validate_prints_nvidias_pipeline_and_context_layouts(capsys):
    """NVIDIA's pp 4 / cp 8 topologies validate at their own world sizes, with the cost-balanced split."""
    sft, long = str(RECIPES_DIR / "glm5" / "sft_4k.yaml"), str(RECIPES_DIR / "glm5" / "sft_32k_cp8.yaml")
    assert main(["config", "validate", sft, long]) == 0
    out = capsys.readouterr().out
    assert out.count("ok   ") == 2 and "FAIL" not in out
    assert "world 256 = dp_replicate 1 x dp_shard 64 x cp 1 x tp 1 x pp 4; ep 64 (expert FSDP 1)" in out
    assert "world 512 = dp_replicate 1 x dp_shard 16 x cp 8 x tp 1 x pp 4; ep 64 (expert FSDP 2)" in out
    assert main(["config", "validate", sft, "--parallel.pp_stages_per_rank=1", "--parallel.pp_schedule=1F1B"]) == 0
    assert "pp stages 20/20/20/18" in capsys.readouterr().out  # dense layers cost less; the head sits last
    # Without pp the same recipe runs: 256 ranks of dp_shard, 64 of them per EP group.
    assert main(["config", "validate", sft, "--parallel.pp=1", "--parallel.pp_schedule=1F1B",
                 "--parallel.pp_stages_per_rank=1", "--parallel.pp_microbatches=null",
                 "--train.micro_batch_size=1"]) == 0
    assert "world 256 = dp_replicate 1 x dp_shard 256 x cp 1 x tp 1 x pp 1; ep 64 (expert FSDP 4)" in (
        capsys.readouterr().out)
    assert main(["config", "validate", TINY, "--parallel.tp=2", "--world-size", "2"]) == 1
    assert "parallel.tp is 2, but tensor parallelism is not built in this version yet" in capsys.readouterr().out


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


def test_validate_refuses_the_precision_settings_train_refuses(capsys):
    lora = str(RECIPES_DIR / "glm5" / "lora_4k.yaml")
    assert main(["config", "validate", lora, "--train.master_weights=fp32"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {lora}\n") and "train.master_weights: fp32 with peft.method: lora" in out
    assert "layout (valid for its world size and model): world 128" in out


@pytest.mark.parametrize("section, key, value, why", [
    ("train", "autocast", "bf16", "glmtune computes in model.dtype (bf16 under fp32 master weights) without "
                                  "torch.autocast"),
    ("optim", "name", "adamw", "the optimizer is always AdamW (optim.fused picks its kernel)"),
])
def test_an_old_recipe_setting_a_removed_key_fails_at_its_line(tmp_path, capsys, section, key, value, why):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"extends: {TINY}\n{section}:\n  {key}: {value}\n")
    line = f"{recipe}:3: {section}.{key} was removed: {why}; delete the line"
    assert main(["config", "validate", str(recipe)]) == 1
    assert capsys.readouterr().out == f"FAIL {recipe}\n    {line}\n"
    assert main(["config", "show", str(recipe)]) == 2
    assert capsys.readouterr().err == f"glmtune config: error: {line}\n"
