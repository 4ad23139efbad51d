"""What --base / --candidate name: HF directories, run directories (SFT and LoRA, also moved), adapters;
their fingerprints, and the refusals (an adapter as base, a base other than the recorded one)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from glmtune.eval.models import Fingerprints, merged_variant, resolve_model
from tests.train.run_helpers import TWO_STEPS, WITH_EXPORT, shared_run


def test_run_directories_hf_directories_and_adapters(shared_results, tmp_path):
    sft = shared_run(shared_results, *WITH_EXPORT).run_dir
    lora = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir
    base, candidate = resolve_model(sft, "base"), resolve_model(sft, "candidate")
    assert (base.kind, base.weights_dir, candidate.weights_dir) == ("run", sft / "base", sft / "hf")
    assert resolve_model(sft / "hf", "candidate").kind == "hf" and candidate.tokenizer_dir == sft / "hf"
    adapter = resolve_model(lora / "adapter", "candidate")
    assert (adapter.kind, adapter.weights_dir, adapter.merged) == ("adapter", lora / "base", False)
    assert adapter.tokenizer_dir == lora / "base"  # adapters carry no tokenizer: the base's
    assert merged_variant(resolve_model(lora, "candidate")).label == "candidate-merged"
    with pytest.raises(ValueError, match="--merged: the candidate .* is not a LoRA adapter"):
        merged_variant(candidate)
    prints = Fingerprints()
    run_print, adapter_print = prints.of(candidate), prints.of(adapter)
    assert set(run_print) == {"config_sha256", "weights_sha256", "path"}
    assert adapter_print["base"]["weights_sha256"] == prints.of(resolve_model(lora, "base"))["weights_sha256"]
    # A moved run directory: the adapter's recorded base path is gone, the base/ beside it is checked by hash.
    moved = shutil.copytree(lora, tmp_path / "moved", ignore=shutil.ignore_patterns("checkpoints"))
    meta = json.loads((moved / "adapter" / "glmtune_adapter.json").read_text())
    meta["base"]["path"] = str(tmp_path / "gone")
    (moved / "adapter" / "glmtune_adapter.json").write_text(json.dumps(meta))
    config = json.loads((moved / "adapter" / "adapter_config.json").read_text())
    (moved / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    found = resolve_model(moved, "candidate")
    assert found.weights_dir == moved / "base" and Fingerprints().of(found)["base"]["path"] == str(moved / "base")
    # One changed weight in that base: not the base the adapter was trained on.
    weights = moved / "base" / "model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is not the base the adapter was trained on \(weights differ"):
        Fingerprints().of(resolve_model(moved, "candidate"))


def test_refusals(shared_results, tmp_path):
    lora = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir
    with pytest.raises(ValueError, match="is a LoRA adapter; the base is a full model"):
        resolve_model(lora / "adapter", "base")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(tmp_path / "none", "candidate")
    with pytest.raises(ValueError, match="neither an HF checkpoint"):
        resolve_model(tmp_path, "candidate")
    unfinished = tmp_path / "run"
    unfinished.mkdir()
    shutil.copy(lora / "config.yaml", unfinished / "config.yaml")
    with pytest.raises(ValueError, match="the LoRA run has no adapter/"):
        resolve_model(unfinished, "candidate")
