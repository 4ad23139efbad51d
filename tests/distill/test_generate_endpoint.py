"""`glmtune distill generate` against a stub OpenAI-compatible teacher (teacher_stub.py) that returns
top-K log-probabilities: the rows, the sidecar and the manifest; malformed log-probabilities, a
teacher without them and one failing midway (one line each, nothing lost, resumable); best-of-n
with --keep-if; a generation SIGKILLed midway and resumed, neither duplicating nor losing rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glmtune.cli import main
from glmtune.data.chat_template import load_chat_template, render_conversation
from glmtune.data.contract import check_conversation
from glmtune.data.sources import Origin
from glmtune.data.synthetic import generate_rows, write_jsonl
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.distill.align import rendered_targets
from glmtune.distill.generate import sample_seed
from glmtune.distill.prompts import read_prompts
from glmtune.distill.topk_store import TopKReader
from tests.distill.teacher_stub import TeacherStub, answer_for

ROWS = 8


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TOKENIZER_DIR)


@pytest.fixture
def stub(tokenizer):
    stub = TeacherStub(tokenizer)
    stub.url = stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def data(tmp_path) -> Path:
    return write_jsonl(generate_rows(ROWS, seed=3), tmp_path / "rows.jsonl")


def _argv(data: Path, out: Path, url: str, *extra: str) -> list[str]:
    return ["distill", "generate", str(data), "--out", str(out), "--teacher", url, "--tokenizer",
            str(TINY_TOKENIZER_DIR), "--max-new-tokens", "64", "--retries", "0", *extra]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _expected(data: Path, tokenizer) -> dict[str, str]:
    """Each prompt's answer from the stub (greedy: seed sample_seed(0, id, 0))."""
    template = load_chat_template(TINY_TOKENIZER_DIR)
    return {p.row_id: answer_for(render_conversation(p.messages, tools=p.tools, template=template,
                                                     tokenizer=tokenizer, enable_thinking=False,
                                                     add_generation_prompt=True), sample_seed(0, p.row_id, 0))
            for p in read_prompts([data])}


def _expected_chat(data: Path) -> dict[str, str]:
    return {p.row_id: answer_for(next(m["content"] for m in reversed(p.messages) if m["role"] == "user"),
                                 sample_seed(0, p.row_id, 0)) for p in read_prompts([data])}


def _check_complete(out: Path, data: Path, tokenizer, k: int = 4, chat: bool = False) -> None:
    """Every prompt answered once, as the stub answers it; the sidecar holds one position per token of
    the rendered last turn: '</think>' (in the teacher's prompt, not generated: no entry), the answer's
    tokens, and the end-of-turn token (the stub's completions report it, as vLLM does; its chat does not)."""
    rows, expected = _rows(out), _expected_chat(data) if chat else _expected(data, tokenizer)
    assert sorted(r["id"] for r in rows) == sorted(expected)  # none lost, none twice
    reader = TopKReader(out / "topk")
    assert sorted(reader.row_ids) == sorted(expected) and reader.k == k
    think, end = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for row in rows:
        assert check_conversation(row, Origin("rows", 1)) == []
        answer = row["messages"][-1]["content"]
        assert answer == expected[row["id"]]
        tokens = tokenizer(answer, add_special_tokens=False)["input_ids"]
        assert rendered_targets(row, tokenizer, load_chat_template(TINY_TOKENIZER_DIR), False) == [think, *tokens, end]
        generated = reader.generated(row["id"]).tolist()
        assert generated == [-1, *tokens, -1 if chat else end]
        ids, logprobs = reader.get(row["id"])
        assert torch.all(ids[0] == -1) and torch.all(torch.isneginf(logprobs[0]))
        taught = slice(1, len(generated) - 1 if chat else len(generated))
        assert ids[taught, 0].tolist() == generated[taught] and torch.all(logprobs[taught, 0] == -0.25)
        assert torch.all(logprobs[taught, 1] == -2.0) and torch.all(logprobs[taught, 1:].diff(dim=-1) < 0)


@pytest.mark.parametrize(("api", "token_ids"), [("completions", True), ("completions", False), ("chat", True),
                                                ("chat", False)])
def test_rows_sidecar_and_manifest(stub, data, tokenizer, tmp_path, capsys, monkeypatch, api, token_ids):
    monkeypatch.setenv("TEACHER_KEY", "sk-secret-123")
    out = tmp_path / "out"
    extra = ["--top-logprobs", "4", "--concurrency", "4", "--api-key-env", "TEACHER_KEY", "--api", api,
             *([] if token_ids else ["--no-token-ids"])]
    assert main(_argv(data, out, stub.url, *extra)) == 0
    _check_complete(out, data, tokenizer, chat=api == "chat")
    manifest = _manifest(out)
    assert manifest["status"] == "complete" and manifest["counts"]["done"] == ROWS
    assert manifest["counts"]["failed"] == 0 and manifest["counts"]["rows_without_topk"] == 0
    assert manifest["teacher"]["model"] == "teacher" and manifest["settings"]["top_logprobs"] == 4
    assert stub.authorization == {"Bearer sk-secret-123"}
    assert not any(b"sk-secret-123" in p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert f"{ROWS} rows done, 0 rejected, 0 failed" in capsys.readouterr().out
    # A rerun asks nothing: every row is done.
    before = stub.total
    assert main(_argv(data, out, stub.url, *extra)) == 0
    assert stub.total == before and len(_rows(out)) == ROWS


@pytest.mark.parametrize(("mode", "reason"), [
    ("wrong_k", "wrong K"), ("out_of_vocab", "id out of vocabulary"), ("short", "tokens do not spell the answer"),
    ("unmappable", "unmappable token"), ("nan", "request failed (malformed)")])
def test_malformed_logprobs_fail_their_rows_and_a_rerun_retries_them(stub, data, tokenizer, tmp_path, capsys, mode,
                                                                      reason):
    out = tmp_path / "out"
    stub.mode = mode
    argv = _argv(data, out, stub.url, "--top-logprobs", "4", *(["--no-token-ids"] if mode == "unmappable" else []))
    assert main(argv) == 3
    printed = capsys.readouterr().err
    failed_line = [line for line in printed.splitlines() if "could not finish" in line]
    assert len(failed_line) == 1 and f"{reason} x{ROWS}" in failed_line[0]
    assert _manifest(out)["counts"]["failures"] == {reason: ROWS} and _rows(out) == []
    assert TopKReader(out / "topk").row_ids == []
    stub.mode = None
    assert main(argv) == 0
    _check_complete(out, data, tokenizer)


def test_a_teacher_without_logprobs_gives_sequence_level_rows(stub, data, tmp_path, capsys):
    stub.mode = "no_logprobs"
    out = tmp_path / "out"
    assert main(_argv(data, out, stub.url, "--top-logprobs", "4")) == 0
    printed = capsys.readouterr().out
    assert printed.count("returned no log-probabilities") == 1
    assert len(_rows(out)) == ROWS and TopKReader(out / "topk").row_ids == []
    counts = _manifest(out)["counts"]
    assert counts["rows_without_topk"] == ROWS and "sequence-level" in counts["note"]


def test_an_engine_refusing_token_ids_is_asked_again_without_them(stub, data, tokenizer, tmp_path, capsys):
    stub.mode = "refuse_ids"
    out = tmp_path / "out"
    assert main(_argv(data, out, stub.url, "--top-logprobs", "4", "--concurrency", "1")) == 0
    assert capsys.readouterr().out.count("refused return_tokens_as_token_ids (http 422)") == 1
    _check_complete(out, data, tokenizer)  # the token strings, mapped, give the same sidecar
    counts = _manifest(out)["counts"]
    assert counts["endpoint"]["failed_requests"] == 0 and len(counts["engine_notes"]) == 1
    assert stub.total == ROWS + 1  # one refused request, asked again


def test_a_teacher_failing_midway_loses_nothing_and_resumes(stub, data, tokenizer, tmp_path, capsys):
    stub.mode, stub.fail_after = "fail", 3
    out = tmp_path / "out"
    argv = _argv(data, out, stub.url, "--top-logprobs", "4", "--concurrency", "1")
    assert main(argv) == 3
    assert "request failed (http 500) x5" in capsys.readouterr().err
    first = _rows(out)
    assert len(first) == 3 and _manifest(out)["status"] == "incomplete"
    stub.mode = None
    assert main(argv) == 0
    _check_complete(out, data, tokenizer)
    assert _rows(out)[:3] == first
    done_first = {r["id"] for r in first}
    assert sum(stub.requests.values()) == 3 + 5 + 5 and max(stub.requests.values()) == 2  # the 3 done: asked once
    assert len(done_first) == 3


def _suite(tmp_path: Path, data: Path) -> Path:
    path = tmp_path / "keep.yaml"
    path.write_text(f"name: keep\nversion: '1'\nsets:\n  - name: s\n    path: {data}\n    scorers: [format]\n")
    return path


def test_best_of_n_keeps_the_first_answer_passing_the_suite(stub, data, tmp_path):
    stub.bad_json = lambda seed: seed % 3 != 0  # one seed of any three in a row answers JSON
    suite = _suite(tmp_path, data)
    keep = ["--temperature", "0.7", "--keep-if", str(suite), "--top-logprobs", "2"]
    assert main(_argv(data, tmp_path / "one", stub.url, *keep, "--samples", "1")) == 0
    one = _manifest(tmp_path / "one")["counts"]
    prompts = read_prompts([data])
    passing = sum(sample_seed(0, p.row_id, 0) % 3 == 0 for p in prompts)
    assert one["done"] == passing and one["rejected"] == ROWS - passing > 0
    assert one["rejections"] == {"keep-if": ROWS - passing}
    rejected = [json.loads(line) for line in (tmp_path / "one" / "rejected.jsonl").read_text().splitlines()]
    assert all(r["reasons"][0].startswith("keep-if: not valid JSON") for r in rejected)
    asked = stub.total
    assert main(_argv(data, tmp_path / "one", stub.url, *keep, "--samples", "1")) == 0
    assert stub.total == asked  # rejected prompts are decided: not asked again
    assert main(_argv(data, tmp_path / "three", stub.url, *keep, "--samples", "3")) == 0
    rows = _rows(tmp_path / "three")
    assert len(rows) == ROWS and all(json.loads(r["messages"][-1]["content"])["product"] == "CloudSync"
                                     for r in rows)
    assert TopKReader(tmp_path / "three" / "topk").row_ids == [r["id"] for r in rows]


@pytest.mark.parametrize(("extra", "message"), [
    (["--samples", "2"], "greedy decoding gives the same answer"),
    (["--batch-size", "4"], "--batch-size applies to an in-process teacher"),
    (["--top-logprobs", "0"], "--top-logprobs 0: expected an integer from 1"),
    (["--keep-if", "missing.yaml"], "missing.yaml"),
    (["--api-key-env", "GLMTUNE_TEST_UNSET_KEY"], "GLMTUNE_TEST_UNSET_KEY: the environment variable is not set"),
])
def test_settings_that_cannot_apply_are_refused_before_anything_is_written(stub, data, tmp_path, capsys, extra,
                                                                          message):
    assert main(_argv(data, tmp_path / "out", stub.url, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmtune distill generate: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and stub.total == 0


def test_foreign_directory_and_changed_settings_are_refused(stub, data, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(_argv(data, foreign, stub.url)) == 2
    assert "not empty" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    assert main(_argv(data, out, stub.url, "--top-logprobs", "4")) == 0
    assert main(_argv(data, out, stub.url, "--top-logprobs", "8")) == 2
    assert "made with another top_logprobs (4, now 8)" in capsys.readouterr().err
    assert len(_rows(out)) == ROWS


def test_a_sidecar_record_without_its_row_is_dropped_on_resume(stub, data, tokenizer, tmp_path):
    """A kill between a row's sidecar record and its line in rows.jsonl: the rerun answers it once."""
    out = tmp_path / "out"
    argv = _argv(data, out, stub.url, "--top-logprobs", "4", "--concurrency", "1")
    assert main(argv) == 0
    lines = (out / "rows.jsonl").read_bytes().splitlines(keepends=True)
    (out / "rows.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # its line cut by the kill
    assert main(argv) == 0
    _check_complete(out, data, tokenizer)


def test_a_killed_generation_resumes_without_duplicates_or_losses(stub, data, tokenizer, tmp_path):
    stub.hold_after = 3  # the 4th request waits: the client is killed while it is in flight
    out = tmp_path / "out"
    argv = _argv(data, out, stub.url, "--top-logprobs", "4", "--concurrency", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "glmtune", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "rows.jsonl").exists() and (out / "rows.jsonl").read_bytes().count(b"\n") >= 3
                   and stub.total >= 4):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the generation did not reach its 4th request"
            time.sleep(0.02)  # polling for the event (3 rows written, the 4th asked), not a fixed wait
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert len(_rows(out)) == 3 and _manifest(out)["status"] == "running"
    stub.release.set()
    assert main(argv) == 0
    _check_complete(out, data, tokenizer)
    assert sorted(stub.requests.values()) == [1] * (ROWS - 1) + [2]  # only the one in flight was asked twice
