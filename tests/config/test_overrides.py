"""Dotted command-line overrides and `extends:` recipe inheritance."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from glmtune.config import load_config


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_both_override_forms(tmp_path):
    path = write(tmp_path, "optim: {lr: 1.0e-4}\n")
    assert load_config(path, ["--optim.lr", "2e-5"]).optim.lr == 2e-5
    assert load_config(path, ["--optim.lr=3e-5"]).optim.lr == 3e-5
    cfg = load_config(path, ["--train.max_steps=7", "--parallel.dp_shard", "-1", "--optim.betas=[0.8, 0.9]"])
    assert (cfg.train.max_steps, cfg.parallel.dp_shard, cfg.optim.betas) == (7, -1, (0.8, 0.9))


def test_later_override_wins_and_dicts_merge(tmp_path):
    cfg = load_config(None, [
        "--model.overrides={num_hidden_layers: 2}", "--model.overrides.hidden_size=64",
        "--train.seed=1", "--train.seed=2",
    ])
    assert cfg.model.overrides == {"num_hidden_layers": 2, "hidden_size": 64}
    assert cfg.train.seed == 2


def test_override_values_are_yaml(tmp_path):
    cfg = load_config(None, ["--train.val_steps=null", "--data.train=[a.jsonl, b.jsonl]", "--peft.rslora=true"])
    assert cfg.train.val_steps is None and cfg.data.train == ["a.jsonl", "b.jsonl"] and cfg.peft.rslora is True


def test_string_fields_keep_numeric_looking_text(tmp_path):
    cfg = load_config(None, ["--name", "123", "--checkpoint.resume=1e3"])
    assert cfg.name == "123" and cfg.checkpoint.resume == "1e3"
    assert cfg.logging.run_dir == "runs/123"  # derived after overrides


def test_override_creates_optional_section(tmp_path):
    cfg = load_config(None, ["--data.synthetic.rows=5"])
    assert cfg.data.synthetic is not None and cfg.data.synthetic.rows == 5


def test_override_unknown_key_says_command_line(tmp_path):
    with pytest.raises(ValueError) as exc:
        load_config(write(tmp_path, "name: x\n"), ["--optim.lrr=1e-4"])
    message = str(exc.value)
    assert "command line (--optim.lrr=1e-4)" in message
    assert "did you mean 'optim.lr'" in message


def test_override_wrong_type_says_command_line(tmp_path):
    with pytest.raises(ValueError, match=r"command line \(--train.max_steps abc\): train.max_steps: expected int"):
        load_config(None, ["--train.max_steps", "abc"])


@pytest.mark.parametrize("tokens, match", [
    (["optim.lr=1"], "expected --section.key=VALUE"),
    (["--optim.lr"], "needs a value"),
    (["--optim.lr", "--train.seed=1"], "needs a value"),
    (["--optim..lr=1"], "malformed key"),
    (["--extends=x.yaml"], "only allowed at the top"),
])
def test_malformed_overrides(tokens, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, tokens)


def test_extends_deep_merges_relative_to_the_file(tmp_path):
    write(tmp_path, """
        name: base
        optim: {lr: 1.0e-4, warmup_steps: 5}
        data: {train: [a.jsonl, b.jsonl], packed_sequence_size: 1024}
    """, "base/base.yaml")
    child = write(tmp_path, """
        extends: ../base/base.yaml
        name: child
        optim: {lr: 2.0e-4}
        data: {train: [c.jsonl]}
    """, "child/child.yaml")
    cfg = load_config(child, ["--optim.warmup_steps=3"])
    assert cfg.name == "child"
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (2e-4, 3)
    assert cfg.data.train == ["c.jsonl"]  # lists replace, they do not concatenate
    assert cfg.data.packed_sequence_size == 1024


def test_extends_chain_error_points_at_the_right_file(tmp_path):
    write(tmp_path, "train:\n  max_stepz: 3\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\nname: b\n", "b.yaml")
    with pytest.raises(ValueError, match=r"a.yaml:2: unknown key 'train.max_stepz'"):
        load_config(tmp_path / "b.yaml")


def test_child_replacing_a_list_forgets_base_item_lines(tmp_path):
    write(tmp_path, "data:\n  train:\n  - a.jsonl\n  - b.jsonl\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\ndata: {train: [1]}\n", "b.yaml")
    with pytest.raises(ValueError, match=r"b.yaml:2: data.train\[0\]: expected str"):
        load_config(tmp_path / "b.yaml")


def test_extends_cycle_and_missing_base(tmp_path):
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(ValueError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path, "extends: nope.yaml\n", "c.yaml")
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "c.yaml")
