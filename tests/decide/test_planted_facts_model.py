"""The retrieval arm on the planted fact set, answered by a real model: its factual-support scoring
end to end on real generations.

The model (tests/decide/reader_model.py) is a tiny Qwen3 trained here for a few steps on the
retrieval arm's own prompts over other seeds' documents: to answer with passage [1] and cite it,
and without passages to say it does not know. It learns the answers' shape (a passage-like text
ending "[1]"; "I do not know." without passages) but is too small to copy a passage faithfully, so
it states some planted facts and invents others: unlike tests/decide/test_planted_facts.py (a reader
that answers only from its prompt's text, which reaches "use retrieval" on 10 of 10), this test
asserts what the scoring makes of what a real model generated. Through `glmtune decide` with real
generation (`generate` wrapped only to record): BM25 showed the passage holding each planted fact
first; the answers are the model's generations; every facts and grounding value (supported,
unsupported claims, passage support, cited, bad citations) equals its definition computed here from
those answers and the passages shown; the base, shown no passage, states no planted fact; and the
verdict follows from the gate on those values.
"""

from __future__ import annotations

import re

import pytest
import torch

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.eval.backends import generate as real_generate
from glmtune.eval.scorers.facts import normalize
from tests.decide.helpers import decision_of, metric, run_cli, small_suite, write_jsonl
from tests.decide.reader_model import ABSTAIN, CHUNK_WORDS, OVERLAP, PASSAGES, train_reader

QUESTIONS = generate_doc_questions(seed=0)[:10]


@pytest.fixture(scope="module")
def reader_dir(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # xdist workers share the cores (as tests/decide/test_decide_e2e.py)
    try:
        yield train_reader(tmp_path_factory.mktemp("reader_model"))
    finally:
        torch.set_num_threads(threads)


class Recording:
    """The real `generate`, recording each (decoded prompt, generated text) pair."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.pairs = tokenizer, []

    def __call__(self, model, prompts, max_new_tokens, **options):
        result = real_generate(model, prompts, max_new_tokens, **options)
        self.pairs += [(self.tokenizer.decode(p), text) for p, text in zip(prompts, result.texts)]
        return result


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def test_retrieval_scoring_on_a_real_models_answers(reader_dir, tmp_path, monkeypatch):
    write_documents(tmp_path / "docs", seed=0)
    write_jsonl(tmp_path / "catalog.jsonl", QUESTIONS)
    suite = small_suite(tmp_path, [{"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]}],
                        [{"metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5}], max_new_tokens=96)
    recording = Recording(load_tokenizer(TINY_TOKENIZER_DIR))
    monkeypatch.setattr("glmtune.eval.backends.generate", recording)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(reader_dir), "--docs", str(tmp_path / "docs"),
                                    "--passages", str(PASSAGES), "--chunk-words", str(CHUNK_WORDS),
                                    "--chunk-overlap", str(OVERLAP), "--out", str(out), "--device", "cpu"])
    decision = decision_of(out)
    assert [a["label"] for a in decision["arms"]] == ["base", "retrieval"], stdout + stderr
    examples = {e["id"]: e for e in decision["scorecard"]["examples"]}
    supported, said, unsupported, cited, bad = [], [], [], [], 0
    for row in QUESTIONS:
        example, [fact] = examples[row["id"]], row["required_facts"]
        [shown] = example["added"]["retrieval"]
        assert fact in shown["text"] and shown["where"].startswith("catalog/"), row["id"]  # BM25 found its page
        answers = {arm: example["outputs"][arm]["text"] for arm in ("base", "retrieval")}
        generated = {("Passages from the documents follow" in prompt): text for prompt, text in recording.pairs
                     if prompt.split("<|user|>")[-1].startswith(row["messages"][0]["content"])}
        assert answers == {"base": generated[False], "retrieval": generated[True]}  # the model's own generations
        assert answers["base"] == ABSTAIN and fact not in answers["base"]
        answer, stated = normalize(answers["retrieval"], False), normalize(fact, False)  # the scorer's matching
        claims = [c for c in row["forbidden_claims"] if normalize(c, False) in answer]
        supported.append(float(stated in answer and not claims))
        unsupported.append(len(claims))
        if stated in answer:  # a stated fact: supported when a passage shown holds it (it does)
            said.append(float(stated in normalize(shown["text"], False)))
        numbers = [int(n) for n in re.findall(r"\[(\d{1,4})\]", answers["retrieval"])]
        cited.append(float(any(n == 1 for n in numbers)))
        bad += sum(n != 1 for n in numbers)
    assert metric(decision, "catalog/facts/supported") == {"base": 0.0, "retrieval": pytest.approx(_mean(supported))}
    assert metric(decision, "catalog/facts/unsupported_claims") == {"base": 0, "retrieval": sum(unsupported)}
    assert metric(decision, "catalog/grounding/passage_support") == {"base": None, "retrieval": _mean(said)}
    assert metric(decision, "catalog/grounding/cited") == {"base": None, "retrieval": pytest.approx(_mean(cited))}
    assert metric(decision, "catalog/grounding/bad_citations") == {"base": None, "retrieval": bad}
    assert _mean(cited) >= 0.8  # the trained shape: answers cite the passage shown
    passes = _mean(supported) >= 0.5
    assert decision["verdict"]["kind"] == ("retrieval" if passes else "fine-tune"), decision["verdict"]
    assert code == (0 if passes else 1), stdout + stderr
