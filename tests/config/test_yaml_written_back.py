"""YAML that glmtune wrote and reads back (a run's config.yaml): aliases refused there too."""

from __future__ import annotations

import pytest

from glmtune.config.yaml_layers import load_yaml_text
from glmtune.train.run_dir import config_changes

BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
BOMB = "l0: &l0 [lol]\n" + BOMB


def test_an_alias_bomb_in_a_runs_config_is_one_line():
    with pytest.raises(ValueError, match=r"the run's config.yaml:2: YAML aliases \(\*l0\) are not allowed"):
        config_changes(BOMB, "train:\n  max_steps: 2\n")


def test_plain_yaml_reads_as_safe_load_would():
    assert load_yaml_text("a: 1\nb: [x, 2e-5]\nc: {d: null}\n", "x") == {"a": 1, "b": ["x", "2e-5"],
                                                                        "c": {"d": None}}
    assert load_yaml_text("", "x") is None
    with pytest.raises(ValueError, match="x: invalid YAML"):
        load_yaml_text("a: [", "x")
    with pytest.raises(ValueError, match="could not determine a constructor"):
        load_yaml_text("a: !!python/object:os.system ls", "x")
