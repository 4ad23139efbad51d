"""Engines' per-token log-probabilities read into the sidecar's arrays (teacher_logprobs.py): the
sampled token on top of the K kept out, fewer than K padded, one id twice refused, token strings and
bytes mapped through the tokenizer (a piece two ids spell alike, or none, refused)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.distill.teacher_logprobs import Malformed, TokenMap, cut_at_stop, from_chat, from_completion


@pytest.fixture(scope="module")
def tokens():
    return TokenMap(load_tokenizer(TINY_TOKENIZER_DIR))


def test_k_plus_one_keeps_the_top_k_and_fewer_are_padded(tokens):
    logprobs = {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-3.0, -0.1],
                "top_logprobs": [{"token_id:1": -0.5, "token_id:2": -1.0, "token_id:5": -3.0},  # sampled beyond top-2
                                 {"token_id:6": -0.1}]}
    topk = from_completion(logprobs, 2, tokens)
    assert topk.generated.tolist() == [5, 6]
    assert topk.ids.tolist() == [[1, 2], [6, -1]]
    assert topk.logprobs[0].tolist() == [-0.5, -1.0] and topk.logprobs[1, 0] == np.float32(-0.1)
    assert math.isinf(topk.logprobs[1, 1]) and topk.logprobs[1, 1] < 0
    with pytest.raises(Malformed, match="wrong K: position 0: 3 alternatives for top-1"):
        from_completion(logprobs, 1, tokens)


def test_one_id_twice_and_a_positive_logprob_are_refused(tokens):
    twice = {"content": [{"token": "token_id:5", "logprob": -0.1, "top_logprobs": [
        {"token": "token_id:5", "logprob": -0.1}, {"token": "token_id:5", "logprob": -0.2}]}]}
    with pytest.raises(Malformed, match="a token id given twice"):
        from_chat(twice, 2, tokens)
    positive = {"tokens": ["token_id:5"], "token_logprobs": [0.5], "top_logprobs": [{"token_id:5": 0.5}]}
    with pytest.raises(Malformed, match="bad log-prob"):
        from_completion(positive, 1, tokens)


def test_strings_and_bytes_map_through_the_tokenizer(tokens):
    tokenizer = load_tokenizer(TINY_TOKENIZER_DIR)
    python = tokenizer(" Python", add_special_tokens=False)["input_ids"]
    assert len(python) == 1 and tokens.id_of(" Python") == python[0]
    assert tokens.id_of("\ufffd", spelled=list(" Python".encode())) == python[0]  # the chat API's bytes win
    assert tokens.id_of("<|user|>") == tokenizer.convert_tokens_to_ids("<|user|>")
    with pytest.raises(Malformed, match="unmappable token"):
        tokens.id_of("\ufffd")  # a byte of a multi-byte character, as engines spell it
    with pytest.raises(Malformed, match="id out of vocabulary"):
        tokens.id_of(f"token_id:{len(tokenizer)}")


def test_the_stop_token_position_is_kept_and_what_follows_it_cut(tokens):
    logprobs = {"tokens": ["token_id:5", "token_id:9", "token_id:7"], "token_logprobs": [-0.1, -0.2, -0.3],
                "top_logprobs": [{"token_id:5": -0.1}, {"token_id:9": -0.2}, {"token_id:7": -0.3}]}
    cut = cut_at_stop(from_completion(logprobs, 1, tokens), {9})
    assert cut.generated.tolist() == [5, 9] and cut.ids.shape == (2, 1)
    assert from_completion(None, 4, tokens) is None and from_chat({"content": None}, 4, tokens) is None
