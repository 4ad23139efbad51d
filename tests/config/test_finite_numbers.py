"""Every number of a recipe is finite and in range: YAML's .nan/.inf, a number beyond float range
and an integer beyond int64 are one line naming file:line (or the flag) and the key; through the
CLI, exit status 2."""

from __future__ import annotations

import math
from typing import Any

import pytest

from glmtune.cli import main
from glmtune.config import JobConfig, load_config, validate_config
from glmtune.config.validate import check_ranges


@pytest.mark.parametrize(("key", "text"), [
    ("optim.lr", ".nan"), ("optim.lr", "-.inf"), ("optim.eps", ".inf"), ("optim.weight_decay", ".nan"),
    ("optim.min_lr_ratio", ".NaN"), ("train.clip_grad_norm", ".inf"), ("train.router_bias_update_rate", ".inf"),
    ("peft.alpha", ".inf"), ("peft.dropout", ".nan"), ("optim.lr", "1e999"), ("optim.lr", "1" + "0" * 400),
])
def test_a_non_finite_float_is_refused_at_its_line(key, text, tmp_path):
    section, name = key.split(".")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\n{section}:\n  {name}: {text}\n")
    with pytest.raises(ValueError) as exc:
        load_config(recipe)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"{recipe}:3: {key}: ") and message.endswith("(a finite number is needed)")


def test_items_of_lists_and_mappings_and_free_values_too(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  betas: [0.9, .inf]\ndata:\n  split: {train: .nan}\n"
                      "model:\n  overrides: {rope_theta: .inf}\ntrain:\n  max_steps: " + "9" * 20 + "\n")
    with pytest.raises(ValueError) as exc:
        load_config(recipe)
    assert str(exc.value).splitlines()[1:] == [
        f"  {recipe}:2: optim.betas[1]: expected float, got inf (a finite number is needed)",
        f"  {recipe}:4: data.split.train: expected float, got nan (a finite number is needed)",
        f"  {recipe}:6: model.overrides.rope_theta: got inf (NaN and infinity are not allowed in a config)",
        f"  {recipe}:8: train.max_steps: expected int, got {'9' * 20} (out of the 64-bit range)",
    ]


def test_the_command_line_is_checked_the_same_way(capsys):
    assert main(["train", "tiny/sft_support_json", "--optim.lr", ".nan"]) == 2
    assert capsys.readouterr().err == ("glmtune train: error: command line (--optim.lr .nan): optim.lr: expected "
                                       "float, got nan (a finite number is needed)\n")
    assert main(["config", "show", "tiny/sft_support_json", "--peft.dropout=-.inf"]) == 2
    assert "peft.dropout: expected float, got -inf (a finite number is needed)" in capsys.readouterr().err


def test_finite_values_still_load():
    cfg = load_config(None, ["--optim.lr=3e-4", "--optim.betas=[0.9, 0.95]", "--train.clip_grad_norm=null",
                             "--data.train=[x.jsonl]"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95) and cfg.train.clip_grad_norm is None


def test_a_config_built_in_code_is_checked_at_validation():
    cfg = JobConfig()
    cfg.data.train = ["x.jsonl"]
    cfg.optim.eps = math.nan
    cfg.peft.alpha = math.inf  # peft.method none: also reported as set without LoRA
    cfg.data.split = {"train": math.nan}
    errors = check_ranges(cfg)
    assert errors[:3] == ["data.split.train must be a finite number, got nan",
                          "optim.eps must be a finite number, got nan",
                          "peft.alpha must be a finite number, got inf"]
    with pytest.raises(ValueError, match="optim.eps must be a finite number, got nan"):
        validate_config(cfg, num_experts=8, num_layers=4)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--optim.lr", "0.5", "--optim.weight_decay", "2"],
     "optim.lr x optim.weight_decay (0.5 x 2) must be < 1: AdamW scales every weight by 1 - lr x weight_decay "
     "each step"),
    (["--optim.lr=-1e-5"], "optim.lr must be > 0, got -1e-05"),
    (["--optim.betas", "[0.9, 1.0]"], "optim.betas must be in [0, 1), got [0.9, 1.0]"),
    (["--train.clip_grad_norm", "0"], "train.clip_grad_norm must be > 0 or null, got 0.0"),
    (["--data.split", "{train: 1.5}"], "data.split ratios must be in (0, 1], got {'train': 1.5, 'validation': 0.05}"),
    (["--peft.method", "lora", "--peft.dropout", "1"], "peft.dropout must be in [0, 1), got 1.0"),
])
def test_recipe_floats_out_of_range_stop_train_before_it_writes(overrides, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "tiny/sft_support_json", *overrides, "--logging.run_dir", str(run_dir)]) == 2
    assert capsys.readouterr().err == f"glmtune train: error: {message}\n"
    assert not run_dir.exists()


def test_the_converter_keeps_values_and_bounds_only_when_asked():
    """Eval suites convert with the same Converter and bound their numbers themselves (their own
    messages): without `finite` a NaN stays NaN and an int past the float range is inf, not a crash."""
    from glmtune.config.loader import Converter

    plain, finite = Converter({}, "x"), Converter({}, "x", finite=True)
    assert math.isnan(plain.convert(math.nan, float, ("t",)))
    assert plain.convert(10**400, float, ("t",)) == math.inf and plain.convert(2**70, int, ("t",)) == 2**70
    assert finite.convert(2.5, float | None, ("t",)) == 2.5 and finite.convert(2**62, int, ("t",)) == 2**62
    for value, tp in ((math.nan, float), (10**400, float), (2**63, int), ([math.inf], Any)):
        with pytest.raises(Exception) as exc:
            finite.convert(value, tp, ("t",))
        assert type(exc.value).__name__ == "_Mismatch"
    finite.convert({"k": [math.inf]}, dict[str, Any], ("t",))  # mapping values: recorded, all reported at once
    assert finite.errors == ["x: t.k: got [inf] (NaN and infinity are not allowed in a config)"]
