"""`data.replay`, the replay mix (glmtune/config/schema.py ReplayConfig, validate.py replay_errors): each
refusal is one sentence naming the key, before anything is read or allocated; the replay recipe validates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glmtune.config import load_config, validate_config
from glmtune.models.registry import model_dims

RECIPE = "recipes/tiny/cpt_domain_text_replay.yaml"


def _errors(*overrides: str) -> str:
    cfg = load_config(RECIPE, list(overrides))
    dims = model_dims(cfg.model)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, dims.num_experts, dims.num_layers)
    return str(info.value)


def test_the_replay_recipe_validates() -> None:
    cfg = load_config(RECIPE)
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers)
    r = cfg.data.replay
    assert (r.kind, r.weight, r.synthetic.kind, cfg.data.kind) == ("chat", 0.2, "support_tickets", "text")


@pytest.mark.parametrize("weight", ["-0.2", "0", "1", "1.5"])
def test_a_weight_outside_zero_to_one_is_refused(weight: str) -> None:
    assert "data.replay.weight must be in (0, 1), the replay's share of the target tokens" in _errors(
        "--data.replay.weight", weight)


@pytest.mark.parametrize("overrides, message", [
    (["--data.replay.synthetic", "null"], "data.replay.train is empty and data.replay.synthetic is not set: nothing "
                                          "to replay"),
    (["--data.replay.kind", "text", "--data.replay.train", "[general.txt]"],
     "data.replay.synthetic generates chat rows but data.replay.kind is text"),
    (["--data.replay.synthetic.kind", "support_preferences"],
     "data.replay.synthetic.kind: support_preferences makes preference rows"),
])
def test_what_a_replay_cannot_be_is_refused(overrides: list[str], message: str) -> None:
    assert message in _errors(*overrides)


def test_a_replay_with_another_objective_is_refused() -> None:
    cfg = load_config(None, ["--data.train", "[x.jsonl]", "--data.replay.train", "[g.jsonl]",
                             "--train.objective", "dpo", "--data.synthetic", "null"])
    dims = model_dims(cfg.model)
    with pytest.raises(ValueError, match=r"data.replay with train.objective: dpo: a replay mix trains the next-token"):
        validate_config(cfg, dims.num_experts, dims.num_layers)


def _validate_cli(tmp_path: Path, replay_lines: str) -> subprocess.CompletedProcess:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(RECIPE).read_text().replace(
        "  replay:\n    kind: chat\n", f"  replay:\n{replay_lines}"))
    return subprocess.run([sys.executable, "-m", "glmtune", "config", "validate", str(recipe)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("replay_lines, message", [
    ("    kind: books\n", "data.replay.kind"),
    # one tokenizer for the mix: a source's own is not a key (they could not differ)
    ("    kind: chat\n    tokenizer: other/tokenizer\n", "unknown key 'data.replay.tokenizer'"),
    ("    kind: chat\n    weights: [0.8, 0.2]\n", "unknown key 'data.replay.weights'"),
])
def test_the_cli_refuses_in_one_line_naming_the_key(tmp_path: Path, replay_lines: str, message: str) -> None:
    done = _validate_cli(tmp_path, replay_lines)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    assert "r.yaml:" in done.stderr + done.stdout  # the file (and line) it is in
