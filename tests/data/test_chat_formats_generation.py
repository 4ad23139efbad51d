"""Templates that mark assistant text with `{% generation %}...{% endgeneration %}`: glmtune's loss
mask is transformers' own `apply_chat_template(..., return_assistant_tokens_mask=True,
return_dict=True)` mask, token for token, on the same ids, whether the template is of a format
glmtune knows (trl's Qwen3 training template, ChatML) or not (trl's Gemma training template); and a
template's blocks must map one to one onto its assistant messages.
"""

from __future__ import annotations

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, load_chat_template, tokenize_conversation, tokenize_reply
from glmtune.data.contract import normalize_row
from glmtune.data.tokenizer import load_tokenizer
from tests.data.chat_format_fixtures import CONVERSATION, TOOL, build_tokenizer

GEMMA_CONVERSATION = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": " Hello! "},
                      {"role": "user", "content": "Where is my order?"},
                      {"role": "assistant", "content": "It shipped yesterday."}]
QWEN3_CASES = [
    (CONVERSATION["messages"], [TOOL]),
    (normalize_row({"messages": [{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "<think>add</think>4"},
                                 {"role": "user", "content": "and 3+3?"},
                                 {"role": "assistant", "content": "6", "reasoning_content": "add again"}]})["messages"],
     None),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation_blocks")
    for name in ("qwen3_training", "gemma_training"):
        build_tokenizer(root / name, name)
    return {name: (load_tokenizer(root / name), load_chat_template(root / name))
            for name in ("qwen3_training", "gemma_training")}


def _transformers(tokenizer, messages, tools):
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


@pytest.mark.parametrize("name, messages, tools", [
    ("qwen3_training", *QWEN3_CASES[0]), ("qwen3_training", *QWEN3_CASES[1]),
    ("gemma_training", GEMMA_CONVERSATION, None)])
def test_the_mask_is_transformers_assistant_tokens_mask(tokenizers, name, messages, tools):
    tokenizer, template = tokenizers[name]
    sample = tokenize_conversation(messages, tokenizer, tools=tools, template=template)
    ids, mask = _transformers(tokenizer, messages, tools)
    assert sample.input_ids == ids
    assert [label != IGNORE_INDEX for label in sample.labels] == mask
    assert any(mask) and not all(mask)
    assert sample.labels == [token if kept else IGNORE_INDEX for token, kept in zip(ids, mask)]


def test_last_assistant_keeps_the_last_block(tokenizers):
    tokenizer, template = tokenizers["gemma_training"]
    sample = tokenize_conversation(GEMMA_CONVERSATION, tokenizer, template=template, loss_on="last_assistant")
    assert tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX]) == "It shipped yesterday.<end_of_turn>\n"


def test_the_reply_of_a_template_known_by_its_blocks_is_the_blocks_after_the_last_user_turn(tokenizers):
    tokenizer, template = tokenizers["gemma_training"]
    reply = tokenize_reply(GEMMA_CONVERSATION, tokenizer, template=template)
    assert tokenizer.decode([t for t in reply.labels if t != IGNORE_INDEX]) == "It shipped yesterday.<end_of_turn>\n"


def test_blocks_that_do_not_match_the_assistant_messages_are_refused(tokenizers):
    tokenizer, _ = tokenizers["gemma_training"]
    once = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{% if loop.last %}{% generation %}{{ m.content }}"
            "<end_of_turn>{% endgeneration %}{% else %}{{ m.content }}<end_of_turn>{% endif %}\n{% endfor %}")
    with pytest.raises(ValueError, match=r"^<chat template text>: the chat template renders 1 \{% generation %\} "
                                         "blocks for 2 assistant messages; it must put each assistant turn's output "
                                         "in one block$"):
        tokenize_conversation(GEMMA_CONVERSATION, tokenizer, template=once)
