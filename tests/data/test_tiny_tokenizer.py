"""The bundled tiny tokenizer: loads offline through AutoTokenizer, GLM-5 special tokens."""

from __future__ import annotations

import pytest

from glmtune.data.chat_template import bundled_template
from glmtune.data.tokenizer import (
    GLM5_CONTROL_TOKENS,
    GLM5_MARKUP_TOKENS,
    GLM5_SPECIAL_TOKENS,
    TINY_TOKENIZER_DIR,
    TINY_VOCAB_SIZE,
    load_tokenizer,
)

EXPECTED_IDS = {"<|endoftext|>": 4064, "[MASK]": 4065, "[gMASK]": 4066, "[sMASK]": 4067, "<sop>": 4068,
                "<eop>": 4069, "<|system|>": 4070, "<|user|>": 4071, "<|assistant|>": 4072, "<|observation|>": 4073}


@pytest.fixture(scope="module")
def auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)


def test_loads_through_auto_tokenizer(auto_tokenizer):
    assert auto_tokenizer.is_fast
    assert len(auto_tokenizer) == TINY_VOCAB_SIZE == 4096
    assert auto_tokenizer.eos_token == auto_tokenizer.pad_token == "<|endoftext|>"
    assert auto_tokenizer.eos_token_id == auto_tokenizer.pad_token_id == 4064
    assert auto_tokenizer.chat_template == bundled_template()
    assert max(auto_tokenizer.get_vocab().values()) == TINY_VOCAB_SIZE - 1


def test_special_tokens_are_single_ids_in_glm5_order(auto_tokenizer):
    assert len(GLM5_SPECIAL_TOKENS) == 32
    ids = [auto_tokenizer.convert_tokens_to_ids(token) for token in GLM5_SPECIAL_TOKENS]
    assert ids == list(range(TINY_VOCAB_SIZE - 32, TINY_VOCAB_SIZE))  # top of the vocab, like GLM-5
    assert {token: auto_tokenizer.convert_tokens_to_ids(token) for token in EXPECTED_IDS} == EXPECTED_IDS
    for token, token_id in zip(GLM5_SPECIAL_TOKENS, ids):
        text = f"a{token}b"
        encoded = auto_tokenizer.encode(text, add_special_tokens=False)
        assert token_id in encoded and encoded.count(token_id) == 1
        assert auto_tokenizer.decode(encoded) == text


def test_decode_skips_control_but_keeps_markup_tokens(auto_tokenizer):
    text = "[gMASK]<sop><|user|>hi<|assistant|><think>r</think><tool_call>f</tool_call><|endoftext|>"
    ids = auto_tokenizer.encode(text, add_special_tokens=False)
    assert auto_tokenizer.decode(ids, skip_special_tokens=True) == "hi<think>r</think><tool_call>f</tool_call>"
    assert set(GLM5_CONTROL_TOKENS) <= set(auto_tokenizer.all_special_tokens)
    assert not set(GLM5_MARKUP_TOKENS) & set(auto_tokenizer.all_special_tokens)


def test_byte_level_round_trip(auto_tokenizer):
    text = "Ünïcödé 🚀 tabs\tand\nnewlines  ORD-48213 {\"k\": [1, 2]}"
    ids = auto_tokenizer.encode(text, add_special_tokens=False)
    assert auto_tokenizer.decode(ids) == text
    assert auto_tokenizer.unk_token_id is None or auto_tokenizer.unk_token_id not in ids


def test_assets_are_small():
    size = sum(path.stat().st_size for path in TINY_TOKENIZER_DIR.iterdir())
    assert size < 1_000_000
    assert {p.name for p in TINY_TOKENIZER_DIR.iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                              "chat_template.jinja"}


def test_load_tokenizer(tmp_path):
    assert len(load_tokenizer(None)) == TINY_VOCAB_SIZE
    assert load_tokenizer(TINY_TOKENIZER_DIR).convert_tokens_to_ids("<|user|>") == 4071
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
