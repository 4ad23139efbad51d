"""`glmtune distill generate` with the teacher in process (the tiny GLM-5 model, an HF directory):
the teacher's top-K equals its own log-softmax over the answer, teacher-forced, and the sidecar holds
it laid on the rendered turn; prompt
rows and chat rows alike; a rerun asks nothing; endpoint-only options are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from glmtune import save_pretrained
from glmtune.cli import main
from glmtune.data.chat_template import load_chat_template, render_conversation
from glmtune.data.synthetic import generate_rows, write_jsonl
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.data.sources import file_sha256
from glmtune.distill.align import align, rendered_targets
from glmtune.distill.prompts import read_prompts
from glmtune.distill.teachers import LocalTeacher
from glmtune.eval.suite import DecodingConfig
from glmtune.distill.topk_store import TopKReader
from glmtune.models.glm5 import build_model, get_preset

K = 4


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    # 16 indexer heads, as tests/generation: with the preset's 4, index scores tie at 0 and the cached
    # decode may select other (equally scored) keys than the full forward (docs/generation.md)
    model = build_model(get_preset("tiny").replace(index_n_heads=16), seed=0).eval()
    hf_dir = tmp_path_factory.mktemp("teacher") / "tiny"
    save_pretrained(model, hf_dir)
    for path in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(path, hf_dir / path.name)
    return model, hf_dir


@pytest.fixture
def data(tmp_path):
    chat = write_jsonl(generate_rows(3, seed=5), tmp_path / "chat.jsonl")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "My PayFlow invoice is wrong.", "id": "q1"}) + "\n"
                       + json.dumps({"prompt": "Reset my password", "system": "Be brief.", "category": "misc"}) + "\n")
    return [chat, prompts]


def test_in_process_topk_equals_the_teacher_forced_distribution(teacher, data, tmp_path):
    model, hf_dir = teacher
    out = tmp_path / "out"
    argv = ["distill", "generate", *map(str, data), "--out", str(out), "--teacher", str(hf_dir), "--top-logprobs",
            str(K), "--max-new-tokens", "6", "--keep-truncated", "--batch-size", "2"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    prompts = {p.row_id: p for p in read_prompts(data)}
    assert sorted(r["id"] for r in rows) == sorted(prompts) and "q1" in prompts
    assert next(r for r in rows if r["id"] != "q1" and "category" in r and r["category"] == "misc")
    tokenizer, template = load_tokenizer(hf_dir), load_chat_template(hf_dir)
    local = LocalTeacher(model, tokenizer, template, DecodingConfig(max_new_tokens=6), K)
    reader = TopKReader(out / "topk")
    for row in rows:
        p = prompts[row["id"]]
        [answer] = local.answer_batch([(p.messages, p.tools)], seed=0)
        raw = answer.topk  # the teacher's own positions: its 6 tokens (cut at max_new_tokens: no stop token)
        assert tokenizer.decode(raw.generated.tolist()) == row["messages"][-1]["content"] and len(raw.generated) == 6
        prompt = tokenizer(render_conversation(p.messages, tools=p.tools, template=template, tokenizer=tokenizer,
                                               enable_thinking=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + raw.generated.tolist()])).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, dim=-1).topk(K, dim=-1)
        assert torch.equal(torch.from_numpy(raw.ids).long(), want.indices)  # greedy: the answer is each top-1
        assert torch.allclose(torch.from_numpy(raw.logprobs), want.values, atol=1e-4)
        # The sidecar: those positions laid on the rendered turn (align), as the student trains on it.
        expected = align(raw, rendered_targets(row, tokenizer, template, False))
        ids, logprobs = reader.get(row["id"])
        assert reader.generated(row["id"]).tolist() == expected.generated.tolist()
        assert torch.equal(ids, torch.from_numpy(expected.ids).long())
        assert torch.allclose(logprobs, torch.from_numpy(expected.logprobs), atol=1e-4)
        assert (expected.generated >= 0).sum() >= 4  # the answer's tokens (a stripped leading space aside)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["teacher"]["kind"] == "hf" and manifest["counts"]["done"] == len(prompts)
    assert manifest["settings"]["tokenizer_sha256"] == file_sha256(hf_dir)  # what the distill loss compares
    assert main(argv) == 0  # resumed: nothing left to answer
    assert json.loads((out / "manifest.json").read_text())["counts"]["written_this_run"] == 0


def test_without_keep_truncated_an_answer_cut_at_max_new_tokens_is_rejected(teacher, data, tmp_path):
    out = tmp_path / "out"
    assert main(["distill", "generate", str(data[1]), "--out", str(out), "--teacher", str(teacher[1]),
                 "--max-new-tokens", "3"]) == 0
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["rejected"] == 2 and counts["rejections"] == {"cut at max_new_tokens": 2}


@pytest.mark.parametrize("option", [["--rate-limit", "2"], ["--concurrency", "2"], ["--api", "chat"]])
def test_endpoint_options_are_refused_with_a_local_teacher(teacher, data, tmp_path, capsys, option):
    assert main(["distill", "generate", str(data[1]), "--out", str(tmp_path / "out"), "--teacher",
                 str(teacher[1]), *option]) == 2
    assert f"{option[0]} applies to an endpoint teacher" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
