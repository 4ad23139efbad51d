"""A resume compares resolved settings: a run saved before `peft.target_modules: null` meant the
family's default (its config.yaml lists the targets) resumed with the recipe's null reports no
change when the family's default for its model is that list (it reported
`peft.target_modules: [...] -> None`), and still reports a list that differs."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import pytest
from rich.console import Console
from transformers import AutoModelForCausalLM, Qwen3Config

from glmtune.config import load_config
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.train import run
from glmtune.train.run_dir import RunDirectory, save_run_config

QWEN3_DEFAULT = ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj",
                 "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=4096, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=16)).save_pretrained(directory)
    return directory


def _resume_said(tmp_path, overrides: list[str], saved_targets: list[str]) -> str:
    """What claiming the run directory for a resume prints, the earlier run having saved `saved_targets`."""
    run_dir = tmp_path / "run"
    overrides = [*overrides, "--logging.run_dir", str(run_dir), "--checkpoint.dir", str(run_dir / "checkpoints")]
    cfg = load_config("tiny/lora_support_json", overrides)
    assert cfg.peft.target_modules is None  # the recipe leaves them to the family
    earlier = RunDirectory(run_dir, run_dir / "checkpoints", print)
    earlier.lock()
    earlier.claim("name: earlier\n", "none", overwrite=False)
    earlier.commit()
    earlier.release()
    save_run_config(dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, target_modules=saved_targets)), run_dir)
    resumed = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=str(run_dir / "ckpt")))
    console = Console(record=True, width=1000)
    with ExitStack() as resources:
        run._claim_run_dir(resumed, False, console, resources, [])
    return console.export_text()


def test_a_null_that_resolves_to_the_saved_targets_is_no_change(tmp_path, qwen3_dir):
    assert "changed settings" not in _resume_said(tmp_path / "glm5", [], list(DEFAULT_LORA_TARGETS))
    hf = ["--model.name_or_path", str(qwen3_dir), "--data.tokenizer", str(TINY_TOKENIZER_DIR)]
    assert "changed settings" not in _resume_said(tmp_path / "hf", hf, QWEN3_DEFAULT)


def test_a_null_that_resolves_to_other_targets_is_a_change(tmp_path):
    said = _resume_said(tmp_path, [], ["*.mlp.gate_proj"])
    assert "resuming with changed settings: peft.target_modules: ['*.mlp.gate_proj'] -> None" in said
