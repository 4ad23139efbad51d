"""The bundled LoRA and DPO recipes (recipes/tiny/lora_support_json.yaml, dpo_support_json.yaml) run
unchanged on a tiny Qwen3 (and Qwen3-MoE) directory through `glmtune train`, a few steps by
overrides: the family's default targets adapted (recorded in trainable.json), the adapters trained
and exported in both layouts, the PEFT one loaded by PEFT onto transformers' model with no missing or
unexpected key; a dense run's adapter merges (`glmtune merge`); two FSDP2 ranks train what one process
does. Before the hf family's LoRA rules, `peft.method: lora` was refused for the family at config time.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from glmtune.cli import main
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.models.hf.quiet import no_progress_bars
from tests.train.run_helpers import command_in_fork, losses, run_in_fork, train_command

peft = pytest.importorskip("peft")

SHAPE = dict(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
CONFIGS = {"qwen3": lambda: Qwen3Config(**SHAPE),
           "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}
FEW_STEPS = ["--data.tokenizer", str(TINY_TOKENIZER_DIR), "--train.max_steps", "2", "--optim.warmup_steps", "1",
             "--checkpoint.every_steps", "2"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """name -> a tiny directory of that architecture with the bundled tokenizer's vocabulary (no tokenizer)."""
    root, dirs = tmp_path_factory.mktemp("hf_lora_recipes"), {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        with no_progress_bars():
            AutoModelForCausalLM.from_config(config(), dtype=torch.float32).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def loads_in_peft(base_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """The adapter as PEFT loaded it onto transformers' model of `base_dir` (no missing, no unexpected key)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, adapter_dir)
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    return peft.utils.get_peft_model_state_dict(model)


@pytest.fixture(scope="module")
def lora_runs(model_dirs, tmp_path_factory):
    """name -> the run directory of the LoRA recipe, a few steps, on that directory (one process)."""
    runs = {}
    for name, base in model_dirs.items():
        root = tmp_path_factory.mktemp(f"lora_{name}")
        done = run_in_fork(root / "run", root / "cache", "--model.name_or_path", str(base), *FEW_STEPS,
                           recipe="tiny/lora_support_json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[name] = root / "run"
    return runs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_lora_recipe_runs_unchanged(model_dirs, lora_runs, tmp_path, name):
    base, run_dir = model_dirs[name], lora_runs[name]
    trainable = json.loads((run_dir / "trainable.json").read_text())
    experts = ["*.mlp.experts"] if name == "qwen3_moe" else ["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]
    assert trainable["target_modules"] == ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj",
                                           "*.self_attn.o_proj", *experts]
    assert sorted(losses(run_dir)) == [1, 2]
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    loaded = loads_in_peft(base, run_dir / "adapter")
    assert set(saved) == set(loaded) and all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert all(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained from B = 0
    assert (run_dir / "adapter_per_expert" / "adapter_model.safetensors").is_file()
    if name == "qwen3":
        assert main(["merge", str(base), str(run_dir / "adapter"), str(tmp_path / "merged")]) == 0


def test_two_ranks_train_the_adapters_one_process_does(model_dirs, lora_runs, tmp_path):
    """FSDP2 on 2 gloo ranks, the model built on meta and each rank filled: the same losses and the
    same exported adapter as one process (the folded experts read their gathered weights)."""
    command_in_fork(train_command(tmp_path / "run", tmp_path / "cache", "--model.name_or_path",
                                  str(model_dirs["qwen3_moe"]), *FEW_STEPS, recipe="tiny/lora_support_json"),
                    tmp_path / "run", nproc=2)
    one = lora_runs["qwen3_moe"]
    assert losses(tmp_path / "run") == pytest.approx(losses(one), rel=1e-5)
    ours, theirs = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (tmp_path / "run", one))
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=1e-5, atol=1e-7, msg=key)


def test_the_dpo_recipe_runs_unchanged(model_dirs, tmp_path):
    """LoRA DPO: the reference is the same model with its adapters off."""
    done = run_in_fork(tmp_path / "run", tmp_path / "cache", "--model.name_or_path", str(model_dirs["qwen3_moe"]),
                       *FEW_STEPS, "--data.synthetic.rows", "80", "--data.packed_sequence_size", "512",
                       recipe="tiny/dpo_support_json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[-1]["dpo/pairs"] > 0
    assert abs(records[0]["loss"] - 0.6931) < 1e-3  # log 2: policy = reference before the first update
    loads_in_peft(model_dirs["qwen3_moe"], tmp_path / "run" / "adapter")
