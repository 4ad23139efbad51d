"""YAML -> JobConfig conversion: unknown keys, wrong types, YAML 1.1 quirks, dump/load round trip."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from glmtune.config import JobConfig, config_from_dict, config_to_dict, dump_config, load_config


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_empty_recipe_gives_defaults_with_run_paths_filled(tmp_path):
    cfg = load_config(write(tmp_path, "# nothing\n"))
    expected = JobConfig()
    expected.logging.run_dir = "runs/glmtune"
    expected.checkpoint.dir = "runs/glmtune/checkpoints"
    assert cfg == expected


def test_unknown_key_names_path_file_line_and_suggests(tmp_path):
    path = write(tmp_path, """
        name: x
        optim:
          lr: 1.0e-4
          warmup_stpes: 10
    """)
    with pytest.raises(ValueError) as exc:
        load_config(path)
    message = str(exc.value)
    assert "optim.warmup_stpes" in message
    assert f"{path}:4" in message
    assert "did you mean 'optim.warmup_steps'" in message


def test_unknown_section_lists_valid_keys_when_nothing_is_close(tmp_path):
    path = write(tmp_path, "zzz_section: {}\n")
    with pytest.raises(ValueError, match=r"recipe.yaml:1: unknown key 'zzz_section'; valid keys: name, description"):
        load_config(path)


def test_wrong_type_names_path_expected_value_and_line(tmp_path):
    path = write(tmp_path, """
        train:
          max_steps: ten
    """)
    with pytest.raises(ValueError) as exc:
        load_config(path)
    message = str(exc.value)
    assert f"{path}:2: train.max_steps: expected int, got 'ten'" in message


def test_all_errors_reported_together(tmp_path):
    path = write(tmp_path, """
        train:
          max_steps: 1.5
          micro_batch_size: true
        model:
          dtype: float16
    """)
    with pytest.raises(ValueError) as exc:
        load_config(path)
    message = str(exc.value)
    assert message.startswith("3 config errors")
    assert "train.max_steps: expected int, got 1.5" in message
    assert "train.micro_batch_size: expected int, got True" in message  # bool is not an int
    assert "model.dtype: expected one of 'float32', 'bfloat16', got 'float16'" in message


def test_floats_accept_ints_and_yaml11_exponent_strings(tmp_path):
    # YAML 1.1 reads `2e-5` (no dot) as a string; it must still mean 2e-5.
    path = write(tmp_path, """
        optim:
          lr: 2e-5
          weight_decay: 0
          betas: [0.9, 1e-1]
    """)
    cfg = load_config(path)
    assert cfg.optim.lr == 2e-5
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)
    assert cfg.optim.betas == (0.9, 0.1)


def test_non_numeric_string_for_float_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="optim.lr: expected float, got 'fast'"):
        load_config(write(tmp_path, "optim: {lr: fast}\n"))


def test_tuple_length_and_list_item_errors(tmp_path):
    with pytest.raises(ValueError, match=r"optim.betas: expected list of 2 float values, got \[0.9\]"):
        load_config(write(tmp_path, "optim: {betas: [0.9]}\n"))
    with pytest.raises(ValueError, match=r"recipe.yaml:4: data.train\[1\]: expected str, got 3"):
        load_config(write(tmp_path, "data:\n  train:\n  - a.jsonl\n  - 3\n"))


def test_unquoted_off_gets_a_yaml_boolean_hint(tmp_path):
    with pytest.raises(ValueError, match="quote the value"):
        load_config(write(tmp_path, "train: {router_bias_update: off}\n"))


def test_union_bool_or_auto(tmp_path):
    assert load_config(write(tmp_path, "optim: {fused: true}\n")).optim.fused is True
    assert load_config(write(tmp_path, "optim: {fused: auto}\n")).optim.fused == "auto"
    with pytest.raises(ValueError, match="optim.fused: expected bool or one of 'auto'"):
        load_config(write(tmp_path, "optim: {fused: maybe}\n"))


def test_checkpoint_save_at_end_is_a_bool(tmp_path):
    assert JobConfig().checkpoint.save_at_end is True
    cfg = load_config(write(tmp_path, "checkpoint:\n  every_steps: 0\n  save_at_end: false\n"))
    assert cfg.checkpoint.save_at_end is False and cfg.checkpoint.every_steps == 0
    assert load_config(write(tmp_path, "{}\n"), ["--checkpoint.save_at_end=false"]).checkpoint.save_at_end is False
    with pytest.raises(ValueError, match="checkpoint.save_at_end: expected bool, got 'never'"):
        load_config(write(tmp_path, "checkpoint:\n  save_at_end: never\n"))
    with pytest.raises(ValueError, match="checkpoint.save_at_end: expected bool, got 0"):
        load_config(write(tmp_path, "checkpoint:\n  save_at_end: 0\n"))


def test_optional_section_null_and_mapping(tmp_path):
    cfg = load_config(write(tmp_path, "data: {synthetic: {rows: 10}}\n"))
    assert cfg.data.synthetic is not None and cfg.data.synthetic.rows == 10 and cfg.data.synthetic.seed == 0
    with pytest.raises(ValueError, match="data.synthetic.rowz"):
        load_config(write(tmp_path, "data: {synthetic: {rowz: 10}}\n"))


def test_duplicate_key_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"recipe.yaml:3: duplicate key 'train.max_steps'"):
        load_config(write(tmp_path, "train:\n  max_steps: 1\n  max_steps: 2\n"))


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_dump_then_load_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, """
        name: roundtrip
        model: {overrides: {num_hidden_layers: 2, rope_parameters: {rope_theta: 1.0e4}}}
        data: {synthetic: {rows: 7}, train: [a.jsonl], split: {train: 0.9, validation: 0.1}}
        optim: {lr: 3e-4, betas: [0.8, 0.9], fused: false}
        peft: {method: lora, exclude_modules: ["*.mlp.experts"]}
    """), ["--parallel.world_size=4"])
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    assert load_config(out) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


REMOVED = {  # key -> why, as the refusal says it (issue 29: keys with one working value)
    "train.autocast": "glmtune computes in model.dtype (bf16 under fp32 master weights) without torch.autocast",
    "optim.name": "the optimizer is always AdamW (optim.fused picks its kernel)",
}


def test_a_removed_key_is_refused_with_its_reason_at_its_line(tmp_path):
    path = write(tmp_path, """
        train:
          max_steps: 10
          autocast: none
        optim:
          name: adamw
          lr: 1.0e-4
    """)
    with pytest.raises(ValueError) as exc:
        load_config(path)
    assert str(exc.value).splitlines() == [
        "2 config errors:",
        f"  {path}:3: train.autocast was removed: {REMOVED['train.autocast']}; delete the line",
        f"  {path}:5: optim.name was removed: {REMOVED['optim.name']}; delete the line",
    ]


def test_a_removed_key_given_on_the_command_line_says_to_drop_the_flag():
    with pytest.raises(ValueError) as exc:
        load_config(None, ["--train.autocast", "bf16"])
    assert str(exc.value) == (f"command line (--train.autocast bf16): train.autocast was removed: "
                              f"{REMOVED['train.autocast']}; drop the flag")


def test_a_runs_saved_config_drops_removed_keys_at_the_values_they_could_have(tmp_path):
    from glmtune.config import load_run_config

    saved = tmp_path / "config.yaml"
    dump_config(load_config("tiny/sft_support_json"), saved)
    text = saved.read_text()
    old = text.replace("train:\n", "train:\n  autocast: none\n", 1).replace("optim:\n", "optim:\n  name: adamw\n", 1)
    saved.write_text(old)
    assert load_run_config(saved) == load_config("tiny/sft_support_json")
    saved.write_text(old.replace("autocast: none", "autocast: bf16", 1))
    with pytest.raises(ValueError, match="train.autocast was removed"):
        load_run_config(saved)
    saved.write_text(old)
    with pytest.raises(ValueError, match="train.autocast was removed"):
        load_config(saved)  # a recipe gets the sentence for every removed key
