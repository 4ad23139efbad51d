"""The generation benchmark's plumbing on CPU: the tiny preset in fp32, exported by glmtune and
loaded by transformers, answers the same left-padded batch with the same greedy tokens in
`glmtune.generation.generate` and in transformers' `generate`, on every row."""

import json

from benchmarks.generation import main

FIELDS = ("glmtune_tok_s", "glmtune_decode_tok_s", "glmtune_prefill_s", "transformers_tok_s",
          "transformers_decode_tok_s", "transformers_prefill_s", "speedup", "first_divergence",
          "tokens_agreeing_before_split", "tokens_total", "max_logit_diff_before_split", "glmtune_repeatable",
          "transformers_repeatable")


def test_tiny_generation_agrees_with_transformers(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert main(["--tiny", "--batches", "1,3", "--prompt", "20", "--new", "8", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["batch"] for line in lines] == [1, 3]
    for line in lines:
        assert all(field in line for field in FIELDS), line
        assert line["glmtune_tok_s"] > 0 and line["transformers_tok_s"] > 0 and line["glmtune_prefill_s"] > 0
        assert line["dtype"] == "float32" and line["preset"] == "tiny"
        # fp32 on the CPU: every row's every token agrees (measured: logits bit-identical)
        assert line["first_divergence"] == [None] * line["batch"] and line["splits"] == []
        assert line["tokens_agreeing_before_split"] == line["tokens_total"] == line["batch"] * 8
        assert line["max_logit_diff_before_split"] <= 1e-4
        assert line["glmtune_repeatable"] and line["transformers_repeatable"]
    assert len(set(lines[1]["prompt_lengths"])) > 1  # the batch is left-padded
    assert "| batch |" in capsys.readouterr().out
