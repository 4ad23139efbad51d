"""Training samples stop at the chat template's own end of turn: a Qwen3 (ChatML) run at
`<|im_end|>`, a Llama-3 run at `<|eot_id|>` (they stopped only at GLM's tokens, so a non-GLM run
generated past its answer up to `max_new_tokens`); their prompts are what transformers'
apply_chat_template renders (Llama-3's `<|begin_of_text|>` first: it was left out)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from glmtune.data.chat_template import load_chat_template, render_conversation
from glmtune.data.tokenizer import load_tokenizer
from glmtune.train.samples import prompt_ids, prompts_from, run_samples
from tests.data.chat_format_fixtures import build_tokenizer

END_OF_TURN = {"qwen3": "<|im_end|>", "llama3_1": "<|eot_id|>"}
ROWS = [{"messages": [{"role": "user", "content": "Where is order 7?"}, {"role": "assistant", "content": "{}"}]}]


def _model_that_ends_its_turn_at_once(tokenizer, template, end_id: int):
    """A tiny transformers causal LM over `tokenizer`'s vocabulary whose first greedy token after the
    prompt is `end_id`: that token's output row points along the prompt's last hidden state."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    text = render_conversation(ROWS[0]["messages"][:-1], template=template, enable_thinking=False,
                               add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        model.lm_head.weight[end_id] = 100 * hidden / hidden.norm()
    return model


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_samples_stop_at_the_templates_end_of_turn(name, tmp_path):
    build_tokenizer(tmp_path, name, vocab_size=400)
    tokenizer, template = load_tokenizer(tmp_path), load_chat_template(tmp_path)
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    model = _model_that_ends_its_turn_at_once(tokenizer, template, end_id)
    [result] = run_samples(model, tokenizer, template, prompts_from(ROWS, 1), max_new_tokens=6)
    assert result.output == ""  # stopped at the end-of-turn token, which is excluded


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_sample_prompts_are_transformers_rendering(name, tmp_path):
    build_tokenizer(tmp_path, name, vocab_size=400)
    tokenizer, template = load_tokenizer(tmp_path), load_chat_template(tmp_path)
    [(row, _)] = prompts_from(ROWS, 1)
    theirs = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
    assert prompt_ids(tokenizer, template, row) == tokenizer(theirs, add_special_tokens=False)["input_ids"]
