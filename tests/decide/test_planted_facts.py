"""The retrieval arm on a planted fact set: questions whose answers appear only in the bundled
documents (`glmtune data synth --kind support_docs` / `support_doc_questions`). BM25 puts the
passage holding each fact first; the retrieval arm answers every question, the base and the
prompted arm none, and the verdict is "use retrieval" (exit 0); its answers are supported by the
passages shown and cite them. The model is the tiny run's, its generation the reader of
tests/decide/reader.py (answers only from its prompt's text: no tiny model reads passages
faithfully). A real model's answers to the same questions: tests/decide/test_planted_facts_model.py."""

from __future__ import annotations

import pytest

from glmtune.data.synthetic import generate_rows
from glmtune.data.synthetic_docs import generate_doc_questions, generate_documents, write_documents
from glmtune.data.tokenizer import load_tokenizer
from glmtune.decide.documents import read_documents
from glmtune.decide.passages import Passages
from tests.decide.helpers import decision_of, metric, run_cli, small_suite, trained_run, write_jsonl
from tests.decide.reader import ReaderGenerate


def test_bm25_ranks_each_planted_facts_passage_first(tmp_path):
    write_documents(tmp_path / "docs", seed=3)
    passages = Passages(read_documents(tmp_path / "docs"), 3)
    for row in generate_doc_questions(seed=3):
        [fact] = row["required_facts"]
        first = passages.for_question(row["messages"][0]["content"])[0]
        assert fact in first.chunk.text and first.chunk.source.startswith("catalog/"), row["messages"][0]
        assert not any(other in first.chunk.text for other in row["forbidden_claims"])


def test_questions_are_answered_only_by_their_seeds_documents():
    docs = "\n".join(generate_documents(seed=0).values())
    for row in generate_doc_questions(seed=0):
        assert row["required_facts"][0] in docs
    other = generate_doc_questions(seed=1)
    assert [r["required_facts"] for r in other] != [r["required_facts"] for r in generate_doc_questions(seed=0)]


@pytest.fixture
def reader(shared_results, monkeypatch):
    run_dir = trained_run(shared_results)
    monkeypatch.setattr("glmtune.eval.backends.generate", ReaderGenerate(load_tokenizer(run_dir / "hf")))
    return run_dir


def test_retrieval_answers_the_planted_facts_and_the_base_does_not(reader, tmp_path):
    write_documents(tmp_path / "docs", seed=0)
    write_jsonl(tmp_path / "catalog.jsonl", generate_doc_questions(seed=0)[:10])
    write_jsonl(tmp_path / "train.jsonl", generate_rows(12, seed=5))
    suite = small_suite(tmp_path, [{"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]}],
                        [{"metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5}], max_new_tokens=64)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(reader / "hf"), "--docs", str(tmp_path / "docs"),
                                    "--examples", str(tmp_path / "train.jsonl"), "--out", str(out), "--device", "cpu"])
    assert code == 0, stdout + stderr
    decision = decision_of(out)
    assert decision["verdict"]["kind"] == "retrieval" and decision["verdict"]["text"].startswith("use retrieval")
    assert "verdict: use retrieval" in stdout
    assert metric(decision, "catalog/facts/supported") == {"base": 0.0, "prompted": 0.0, "retrieval": 1.0}
    assert metric(decision, "catalog/facts/unsupported_claims") == {"base": 0, "prompted": 0, "retrieval": 0}
    assert metric(decision, "catalog/grounding/passage_support") == {"base": None, "prompted": None, "retrieval": 1.0}
    assert metric(decision, "catalog/grounding/cited") == {"base": None, "prompted": None, "retrieval": 1.0}
    assert metric(decision, "catalog/grounding/bad_citations")["retrieval"] == 0
    for example in decision["scorecard"]["examples"]:
        fact = next(r for r in generate_doc_questions(seed=0) if r["id"] == example["id"])["required_facts"][0]
        shown = example["added"]["retrieval"]
        assert fact in shown[0]["text"] and example["outputs"]["retrieval"]["text"].endswith("[1]")
        assert example["outputs"]["base"]["text"] == "I do not know."
        assert len(example["added"]["prompted"]) == 3  # the first 3 tickets of train.jsonl
    assert (out / "decision.md").read_text().startswith("# Decision: use retrieval")
    assert "The retrieval arm" in (out / "decision.html").read_text()
