"""`glmtune decide` through a real server: `transformers serve` (tests/eval/test_endpoint.py's
harness) serving the tiny run's export on 127.0.0.1 as the base, in completions mode (glmtune
renders the suite's chat template). The base's three arms go through the server, the run itself is
the local alternative (and gives the run_split set its rows). The same decision made with the
export in this process answers the same prompts: the arms' texts agree (greedy; the engine's
kernels may flip a near-tie, as eval's endpoint test allows), and the verdict and gate results are
the same."""

from __future__ import annotations

import json

import pytest
import torch

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from tests.decide.helpers import BUNDLED, TICKET_SCORERS, decision_of, run_cli, small_suite, trained_run, write_jsonl
from tests.eval.test_endpoint import _serve, _stop


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _suite(tmp_path):
    write_jsonl(tmp_path / "catalog.jsonl", generate_doc_questions(seed=0)[:3])
    refusal = [json.loads(line) for line in (BUNDLED / "eval_support_json" / "refusal.jsonl").read_text().splitlines()]
    write_jsonl(tmp_path / "refusal.jsonl", [refusal[1], refusal[7]])
    sets = [{"name": "tickets", "run_split": "validation", "limit": 2, "scorers": TICKET_SCORERS},
            {"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]},
            {"name": "refusal", "path": "refusal.jsonl", "scorers": ["refusal"]}]
    gates = [{"name": "exact", "metric": "tickets/task_success/exact", "rule": "min", "threshold": 0.2},
             {"name": "facts", "metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5},
             {"name": "refusals", "metric": "refusal/refusal/accuracy", "rule": "no_regression"}]
    return small_suite(tmp_path, sets, gates, max_new_tokens=12)


def test_the_arms_through_transformers_serve_answer_as_in_process(shared_results, tmp_path, one_thread):
    run_dir = trained_run(shared_results)
    suite = _suite(tmp_path)
    write_documents(tmp_path / "docs", seed=0)
    arms = ["--examples", str(run_dir), "--docs", str(tmp_path / "docs"), "--compare", f"{run_dir},name=trained"]
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(run_dir / "hf"), *arms,
                                    "--out", str(tmp_path / "local"), "--device", "cpu"])
    assert code == 1, stdout + stderr
    process, url = _serve(run_dir / "hf", tmp_path / "serve.log")
    try:
        code, stdout, stderr = run_cli(["decide", str(suite), "--base", url, "--tokenizer", str(run_dir / "hf"), *arms,
                                        "--out", str(tmp_path / "served"), "--device", "cpu"])
    finally:
        _stop(process)
    assert code == 1, stdout + stderr
    local, served = decision_of(tmp_path / "local"), decision_of(tmp_path / "served")
    assert served["scorecard"]["models"][0]["kind"] == "endpoint"
    assert [m["kind"] for m in served["scorecard"]["models"][1:3]] == ["endpoint", "endpoint"]
    pairs = [(a["outputs"][label]["text"], b["outputs"][label]["text"])
             for a, b in zip(local["scorecard"]["examples"], served["scorecard"]["examples"])
             for label in ("base", "prompted", "retrieval")]
    same = sum(x == y for x, y in pairs)
    print(f"decide through transformers serve: {same} of {len(pairs)} arm answers equal in-process")
    assert same >= len(pairs) - 2, [p for p in pairs if p[0] != p[1]]
    assert served["verdict"]["kind"] == local["verdict"]["kind"] == "fine-tune"
    gates = [[(g["name"], g["model"], g["passed"]) for g in d["scorecard"]["gates"]] for d in (local, served)]
    assert gates[0] == gates[1]
    for example in served["scorecard"]["examples"]:  # the same passages and examples were added either way
        twin = next(e for e in local["scorecard"]["examples"] if (e["set"], e["id"]) == (example["set"], example["id"]))
        assert example["added"] == twin["added"]
