"""General text: only the prefix `max_tokens` needs is read and tokenized, and it gives the same
windows as the whole text would."""

from __future__ import annotations

import tracemalloc

import pytest

from glmtune.data.tokenizer import load_tokenizer
from glmtune.eval.general_text import read_prefix, text_windows

PROSE = ("The ferry left the harbour at seven forty, an hour late, and the gulls followed it past the "
         "breakwater while the passengers argued about the weather. ")


def test_a_large_file_costs_only_the_prefix_max_tokens_needs(tmp_path):
    path = tmp_path / "general.txt"
    with path.open("w") as f:
        for _ in range(24 * (1 << 20) // len(PROSE)):  # 24 MB
            f.write(PROSE)
    tokenizer = load_tokenizer()
    tracemalloc.start()
    try:
        windows = text_windows(tokenizer, path, 256, 128)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Reading the whole file was 24 MB of text and a list of millions of token ids.
    assert peak < 2 * (1 << 20), f"peak {peak:,} bytes"
    assert [len(w) for w in windows] == [128, 128]
    whole = tokenizer(PROSE * 40, add_special_tokens=False)["input_ids"][:256]
    assert [t for w in windows for t in w] == whole  # the prefix tokenizes as the full text


def test_the_prefix_ends_on_a_whole_word_and_a_whole_character(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld abc", encoding="utf-8")
    assert read_prefix(path, 3) == "hé"  # no whitespace to cut at: the bytes that decode
    assert read_prefix(path, 10) == "héllo"  # "héllo wö" cut inside a word: back to the last space
    assert read_prefix(path, 100) == "héllo wörld abc"
    path.write_bytes(b"ok \xff then")
    with pytest.raises(ValueError, match=r"t.txt: general_text must be UTF-8 \(invalid start byte at byte 3\)"):
        read_prefix(path, 100)
