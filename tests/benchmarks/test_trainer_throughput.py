"""benchmarks/trainer_throughput.py's `--data`: the proxy's trainer on chat rows and on raw text
(`data.kind: text`) in one call, with their ratio (issue 47's H200 measurement), smoke-tested on
the tiny preset (`--tiny`, CPU): each run trains in its own `glmtune train` process."""

from __future__ import annotations

import json

import pytest

from benchmarks import trainer_throughput

pytestmark = pytest.mark.subprocess


def test_both_trains_chat_then_text_and_reports_their_ratio(tmp_path):
    out = tmp_path / "trainer.jsonl"
    assert trainer_throughput.main(["--tiny", "--data", "both", "--seq", "128", "--steps", "2", "--log-every", "1",
                                    "--skip-reference", "--out", str(out), "--work", str(tmp_path)]) == 0
    chat, text, ratio = (json.loads(line) for line in out.read_text().splitlines())
    assert (chat["data"], text["data"]) == ("chat", "text") and len(text["windows_tok_s"]) == 2
    assert chat["fill"] == 1.0  # every chat row one truncated conversation
    # documents of ~3 rows split at the row's length: mostly full chunks, the last ones packed together
    assert text["packing"]["num_rows"] >= 10 and 0.85 < text["fill"] <= 1.0
    assert text["packing"]["num_tokens"] == round(text["fill"] * text["packing"]["num_rows"] * 128)
    assert ratio["impl"] == "text / chat" and (ratio["chat_tok_s"], ratio["text_tok_s"]) == (
        chat["steady_tok_s"], text["steady_tok_s"])
    assert ratio["ratio"] == round(text["steady_tok_s"] / chat["steady_tok_s"], 3) > 0


def test_text_recipe_is_raw_text_with_the_chat_runs_settings(tmp_path):
    """The text run changes only the data section: the same proxy, batch, compile, optimizer."""
    a = trainer_throughput.parse_args(["--data", "text"])
    chat = trainer_throughput.recipe(a, tmp_path / "c.jsonl", tmp_path / "run", "chat")
    text = trainer_throughput.recipe(a, tmp_path / "d.jsonl", tmp_path / "run", "text")
    assert {k: v for k, v in chat.items() if k != "data"} == {k: v for k, v in text.items() if k != "data"}
    assert text["data"]["kind"] == "text" and text["data"]["long_documents"] == "split"
    assert text["data"]["packed_sequence_size"] == chat["data"]["packed_sequence_size"] == 4096
    with pytest.raises(SystemExit):
        trainer_throughput.parse_args(["--data", "both", "--profile"])
