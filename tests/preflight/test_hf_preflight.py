"""Preflight on an hf-family directory (a tiny Qwen3 built from config, the recipe's tiny tokenizer):
the checks reach the family through its spec, so each passes on its evidence instead of stopping on
GLM-5's field names, and what the family cannot do is said in one sentence.

  pins      transformers must have the model's own class (not GLM-5's)
  model     the config's architecture is accepted and described (layers, experts, hidden size)
  trainable the family's groups are inventoried (full fine-tuning and LoRA)
  step, gradients, export, generation  on one in-process reference run of the whole model (the
            family writes no K-layer view: `--layers auto` trains a small model whole, refuses a
            large one, and `--layers K` is refused before anything runs)
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.preflight.context import Preflight
from glmtune.preflight.export import check_export
from glmtune.preflight.generation import check_generation, decoding_for
from glmtune.preflight.loading import check_model
from glmtune.preflight.pins import check_pins
from glmtune.preflight.runs import run_reference
from glmtune.preflight.step import check_gradients, check_step
from glmtune.preflight.trainable import check_trainable
from tests.data.chat_format_fixtures import build_tokenizer
from tests.preflight.conftest import LORA, SFT

SHAPES = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 directory whose vocabulary holds the tiny tokenizer's 4096 tokens."""
    directory = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**SHAPES)).save_pretrained(directory)
    return directory


def _preflight(tmp_path, model_dir, recipe=SFT, *overrides, **options) -> Preflight:
    return Preflight(recipe, ["--model.name_or_path", str(model_dir), "--data.tokenizer", str(TINY_TOKENIZER_DIR),
                              *overrides], tmp_path / "out", **options)


def test_checks_1_to_4_describe_the_familys_model(qwen3_dir, tmp_path):
    pf = _preflight(tmp_path, qwen3_dir)
    assert check_pins(pf).status == "pass"
    model = check_model(pf)
    assert model.status == "pass", model.message
    assert model.message.startswith("Qwen3ForCausalLM on meta (598,400 parameters, nothing read): 2 layers (2 dense, "
                                    "0 MoE), 0 experts, hidden 64;")
    trainable = check_trainable(pf)
    assert trainable.status == "pass", trainable.message
    assert trainable.message.startswith("full fine-tuning: 598,400 of 598,400 parameters train (100%)")
    lora = check_trainable(_preflight(tmp_path, qwen3_dir, LORA))
    assert lora.status == "pass" and lora.message.startswith("LoRA r=8 on 14 modules"), lora.message


def test_layers_without_a_view_of_the_checkpoint(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="--layers 1: a view of a checkpoint's first layers is not available for "
                                         "the hf family; use --layers all"):
        _preflight(tmp_path, qwen3_dir, layers=1)
    assert _preflight(tmp_path, qwen3_dir).scratch_layers() is None  # auto: the small model whole
    large = tmp_path / "large"  # a config alone: Qwen3-8B's shapes (8.2B parameters)
    large.mkdir()
    (large / "config.json").write_text(json.dumps({
        **Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128).to_dict(),
        "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"a view of its first layers is not available for the hf family, and its "
                                         r"8,190,735,360 parameters are more than checks 5-10 step whole"):
        _preflight(tmp_path, large).scratch_layers()


def test_step_gradients_export_and_generation_on_the_whole_model(qwen3_dir, tmp_path):
    pf = _preflight(tmp_path, qwen3_dir)
    ref = run_reference(pf)
    step = check_step(pf, ref)
    assert step.status == "pass", step.message
    assert step.message.endswith(f"{qwen3_dir} (all layers), cpu float32")
    gradients = check_gradients(pf, ref)
    assert gradients.status == "pass", gradients.message
    paths = gradients.evidence["paths"]
    assert {g for g, p in paths.items() if p["total"]} == {"embeddings", "attention", "mlp", "norm", "head"}
    assert all(p["state"] == "finite, non-zero" for p in paths.values() if p["total"])
    export = check_export(pf, ref)
    assert export.status == "pass", export.message
    assert export.evidence["probe"] == "the first 512 tokens of the first training row"  # no sparse attention
    assert export.evidence["logits"]["max_abs_difference"] <= 1e-4
    generation = check_generation(pf, ref)
    assert generation.status == "pass", generation.message


FORMAT_STOPS = {"qwen3": ("ChatML", ("<|im_end|>", "<|endoftext|>")),
                "llama3_1": ("Llama-3", ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"))}


@pytest.mark.parametrize("name", sorted(FORMAT_STOPS))
def test_template_checks_follow_the_templates_turn_format(qwen3_dir, tmp_path, name):
    """The tiny Qwen3 with a ChatML (Qwen3's) or Llama-3.1 tokenizer and template: check 3 passes
    on that format's turns and tokens (it required GLM-5's [gMASK]<sop> and role tokens), and check
    9 decodes to the format's end-of-turn tokens (it stopped at GLM's)."""
    turn_format, stops = FORMAT_STOPS[name]
    tokenizer = build_tokenizer(tmp_path / "tokenizer", name)
    pf = Preflight(SFT, ["--model.name_or_path", str(qwen3_dir), "--data.tokenizer", str(tmp_path / "tokenizer")],
                   tmp_path / "out")
    model = check_model(pf)
    assert model.status == "pass", model.message
    assert f"with {turn_format} turns" in model.message
    assert model.evidence["chat_template"]["turn_format"] == turn_format
    prompts = [({"messages": [{"role": "user", "content": "Where is order 7?"}]}, "{}")]
    assert decoding_for(tokenizer, tokenizer.chat_template, prompts).stop_tokens == stops
    broken = tmp_path / "broken"  # the format's template whose generation prompt opens no assistant turn
    build_tokenizer(broken, name)
    (broken / "chat_template.jinja").write_text(tokenizer.chat_template.replace("assistant", "helper"))
    pf = Preflight(SFT, ["--model.name_or_path", str(qwen3_dir), "--data.tokenizer", str(broken)], tmp_path / "out2")
    failed = check_model(pf)
    assert failed.status == "fail"
    problems = failed.evidence["problems"]
    assert any("the generation prompt ends" in p and "helper" in p for p in problems), problems
    if name == "qwen3":  # Llama-3.1's template writes a message's role as it is: its turns still render
        assert any("renders 0 ChatML assistant turns for the data's" in p for p in problems), problems
