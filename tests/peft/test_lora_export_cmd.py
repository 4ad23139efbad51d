"""`glmtune export RUN_DIR --adapter OUT`: rebuild the run's model, load its newest
adapter-only checkpoint, write the adapter; plus what a LoRA checkpoint holds."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from glmtune.checkpoint.dcp_storage import JsonMetadataReader
from glmtune.checkpoint.manager import CheckpointManager
from glmtune.cli import main
from glmtune.config import dump_config, load_config
from glmtune.peft import adapter_state, apply_lora
from glmtune.train.model_source import build_model_from_config
from tests.peft.conftest import randomize_adapters


def _trained_run(run_dir):
    cfg = load_config("recipes/tiny/lora_support_json.yaml", [f"--logging.run_dir={run_dir}"])
    dump_config(cfg, run_dir / "config.yaml")
    model, _ = build_model_from_config(cfg, "cpu")
    apply_lora(model, cfg.peft)
    randomize_adapters(model, seed=5)  # stands in for training
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoint = CheckpointManager(cfg.checkpoint.dir, trainable_only=True).save(7, model, optimizer, {})
    return model, checkpoint


def test_export_command_writes_the_checkpointed_adapter(tmp_path, capsys):
    run_dir = tmp_path / "run"
    model, checkpoint = _trained_run(run_dir)
    model_keys = [k for k in JsonMetadataReader(checkpoint).read_metadata().state_dict_metadata
                  if k.startswith("model.")]
    # Adapter-only checkpoint: the LoRA factors, and the router's bias buffers (balancing state).
    assert model_keys and all(".lora_" in k or k.endswith("e_score_correction_bias") for k in model_keys)

    # Loading needs CheckpointManager to load trainable-only state non-strictly
    # (StateDictOptions(strict=False) when trainable_only): the frozen base is not in it.
    moved = shutil.move(run_dir, tmp_path / "moved")  # the recorded checkpoint.dir no longer exists
    for layout in ("peft", "per_expert"):
        out = tmp_path / f"out-{layout}"
        assert main(["export", str(moved), "--adapter", str(out), "--layout", layout]) == 0
        assert "step 7" in capsys.readouterr().out
        _, expected = adapter_state(model, layout)
        saved = load_file(out / "adapter_model.safetensors")
        assert set(saved) == set(expected)
        for key, tensor in expected.items():
            assert torch.equal(saved[key], tensor), key


def test_export_command_errors(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--adapter", str(tmp_path / "a")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    cfg = load_config("recipes/tiny/sft_support_json.yaml", [f"--logging.run_dir={tmp_path}"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert main(["export", str(tmp_path), "--adapter", str(tmp_path / "a")]) == 2
    assert "only LoRA runs have an adapter" in capsys.readouterr().err
