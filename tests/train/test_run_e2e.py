"""`glmtune train` end to end on the tiny recipe: run directory contents, HF export that
transformers loads with our logits, and a data-contract error that stops the run early."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from glmtune import load_pretrained
from tests.train.run_helpers import TWO_STEPS, losses, run, run_in_fork, shared_run


def test_short_run_writes_everything_and_exports_loadable_hf(tmp_path):
    run_dir = tmp_path / "run"
    result = run(run_dir, tmp_path / "cache", "--train.max_steps", "4", "--checkpoint.export_hf", "true",
                 "--train.generate_samples", "1", "--train.val_every", "2", "--logging.tensorboard", "true")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "before -> after" in result.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["max_steps"] == 4 and config["model"]["name_or_path"] == "tiny"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"step", "loss", "lr", "tokens", "grad_norm", "tokens_per_s"} <= records[0].keys()
    assert any(k.startswith("moe/model.layers.2.mlp/") for k in records[0])
    assert "val_loss" in records[1]
    assert list((run_dir / "tensorboard").iterdir())

    hf_dir = run_dir / "hf"
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    ours = load_pretrained(hf_dir, dtype=torch.float32, attention_backend="eager")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer("[gMASK]<sop><|user|>My invoice is wrong<|assistant|>", add_special_tokens=False,
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (reference(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4


def test_save_at_end_false_writes_no_checkpoint_and_says_so(tmp_path):
    """Throughput probes: no every_steps save and none at the end, yet the run finishes normally."""
    run_dir = tmp_path / "run"
    result = run_in_fork(run_dir, tmp_path / "cache", "--train.max_steps", "2", "--checkpoint.every_steps", "0",
                         "--checkpoint.save_at_end", "false")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the trained weights will not be kept" in result.stdout
    assert "finished step 2" in result.stdout
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.iterdir())
    assert sorted(losses(run_dir)) == [1, 2]


def test_contract_violation_stops_before_training(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{}"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    data = tmp_path / "tickets.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    result = run(tmp_path / "run", tmp_path / "cache", "--data.synthetic", "null", "--data.train", f"[{data}]")
    assert result.returncode == 2
    assert f"{data}:3" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_pii_fail_policy_names_the_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"ticket {i}"}, {"role": "assistant", "content": "{}"}]}
            for i in range(3)]
    rows[1]["messages"][0]["content"] = "my key is sk-abcdefghijklmnopqrstuvwxyz123456"
    data = tmp_path / "tickets.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = run(tmp_path / "run", tmp_path / "cache", "--data.synthetic", "null", "--data.train", f"[{data}]",
                 "--data.pii", "fail")
    assert result.returncode == 2
    assert f"{data}:2" in result.stderr and "data.pii" in result.stderr
    report = json.loads((tmp_path / "run" / "pii_report.json").read_text())
    assert report["num_findings"] == 1


def test_lora_run_exports_adapters_and_saves_small_checkpoints(shared_results):
    # The run tests/distributed/test_pipeline_train.py compares pp 2 against.
    run_dir = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir
    inventory = json.loads((run_dir / "trainable.json").read_text())
    assert "routed_experts" in json.dumps(inventory)
    for sub in ("adapter", "adapter_per_expert"):
        assert (run_dir / sub / "adapter_config.json").is_file()
        assert (run_dir / sub / "adapter_model.safetensors").is_file()
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    ckpt_bytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    model_bytes = sum(f.stat().st_size for f in (run_dir / "adapter").rglob("*.safetensors"))
    # adapters + their two Adam moments + state: a few times the adapter, far below the 2.2M-param base
    assert ckpt_bytes < 8 * model_bytes + 2_000_000


def test_rerunning_a_finished_run_is_a_no_op(tmp_path, shared_results):
    first = shared_run(shared_results, *TWO_STEPS)  # also test_progress.py's and test_run_dir_safety.py's run
    run_dir = shutil.copytree(first.run_dir, tmp_path / "run")
    again = run_in_fork(run_dir, first.cache_dir, *TWO_STEPS, "--checkpoint.resume", "auto")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already at train.max_steps (2)" in again.stdout
    assert sorted(losses(run_dir)) == [1, 2]


def test_sft_run_on_a_preset_writes_its_initial_weights_as_base(shared_results):
    from glmtune.models.registry import hf_dir_identity
    from glmtune.models.glm5 import build_model, get_preset

    run_dir = shared_run(shared_results, *TWO_STEPS).run_dir
    base = load_pretrained(run_dir / "base", dtype=torch.float32).state_dict()
    initial = build_model(get_preset("tiny"), torch.float32, seed=1234).state_dict()  # the recipe's train.seed
    assert base.keys() == initial.keys() and all(torch.equal(base[k], initial[k]) for k in base)
    assert json.loads((run_dir / "run.json").read_text())["base"] == hf_dir_identity(run_dir / "base")
    assert (run_dir / "base" / "tokenizer.json").is_file()
    manifest = json.loads((run_dir / "data_manifest.json").read_text())  # the held-out split `glmtune eval` reads
    [validation] = manifest["validation_files"]
    assert Path(validation).parent == run_dir / "data" and Path(validation).is_file()
