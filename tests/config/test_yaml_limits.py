"""Recipe and suite YAML that would exhaust memory or the stack is one line naming file:line:
aliases (a billion-laughs file), nesting, size; an anchor alone is harmless and loads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.config import load_config
from glmtune.config.yaml_layers import MAX_RECIPE_BYTES, MAX_YAML_DEPTH, read_yaml_layer


def _bomb(levels: int = 9) -> str:
    """`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]`, ...: 9**levels strings once expanded."""
    lines = ["name: bomb", "description: &a [x, x, x, x, x, x, x, x, x]"]
    previous = "a"
    for index in range(1, levels):
        name = f"l{index}"
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once(tmp_path, capsys):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(_bomb())
    start = time.perf_counter()
    assert main(["train", str(recipe)]) == 2
    assert time.perf_counter() - start < 5  # expanding it would take hours and all memory
    assert capsys.readouterr().err == (f"glmtune train: error: {recipe}:3: YAML aliases (*a) are not allowed in a "
                                       "recipe; write the value out\n")


def test_an_alias_is_refused_in_a_suite_too_with_its_kind(tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text("base: &b {x: 1}\nother: *b\n")
    with pytest.raises(ValueError, match=r"^.*suite.yaml:2: YAML aliases \(\*b\) are not allowed in a suite; "):
        read_yaml_layer(suite, kind="suite")


def test_a_merge_key_through_an_alias_is_an_alias(tmp_path):
    recipe = tmp_path / "merge.yaml"
    recipe.write_text("optim: &o\n  lr: 0.1\npeft:\n  <<: *o\n")
    with pytest.raises(ValueError, match=r"merge.yaml:4: YAML aliases \(\*o\) are not allowed in a recipe"):
        load_config(recipe)


def test_an_anchor_alone_is_harmless_and_loads(tmp_path):
    recipe = tmp_path / "anchor.yaml"
    recipe.write_text("name: &n anchored\noptim: &o\n  lr: 0.001\n")
    cfg = load_config(recipe)
    assert cfg.name == "anchored" and cfg.optim.lr == 0.001


def test_an_alias_on_the_command_line_is_refused(tmp_path):
    value = "{a: &a [1, 1, 1], b: [*a, *a, *a]}"
    with pytest.raises(ValueError, match=r"^command line \(--model.overrides=.*\): YAML aliases \(\*a\) are not "
                                         r"allowed in a command-line value; write the value out$"):
        load_config(None, [f"--model.overrides={value}"])


def test_nesting_is_bounded(tmp_path):
    recipe = tmp_path / "deep.yaml"
    recipe.write_text("model:\n  overrides:\n    x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match=rf"deep.yaml:3: nested deeper than {MAX_YAML_DEPTH} levels$"):
        load_config(recipe)
    fits = "[" * 50 + "]" * 50  # with the 3 levels above it, within the bound
    recipe.write_text(f"model:\n  overrides:\n    x: {fits}\n")
    assert load_config(recipe).model.overrides["x"] == eval(fits)
    with pytest.raises(ValueError, match=rf"nested deeper than {MAX_YAML_DEPTH} levels"):
        load_config(None, ["--model.overrides.x", "[" * 5000 + "]" * 5000])


def test_size_is_capped(tmp_path, capsys):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("name: big\n" + "# padding\n" * (MAX_RECIPE_BYTES // 10))
    assert main(["train", str(recipe)]) == 2
    assert capsys.readouterr().err == (f"glmtune train: error: {recipe}: more than {MAX_RECIPE_BYTES:,} bytes, too "
                                       "large for a recipe (a few KiB is usual)\n")
    recipe.write_text("name: big\n" + "#" * (MAX_RECIPE_BYTES - 20) + "\n")
    assert load_config(recipe).name == "big"


def test_shipped_recipes_are_far_below_the_caps():
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    for path in recipes.rglob("*.yaml"):
        assert path.stat().st_size < MAX_RECIPE_BYTES // 64, path
        read_yaml_layer(path)  # no aliases, nesting within the bound
