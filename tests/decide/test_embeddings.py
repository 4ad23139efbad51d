"""`--retriever embeddings:DIR`: the retrieval arm's passages ranked by a local embedding model.

The model is a tiny BERT built from its config (seeded, no download) with the bundled tokenizer
beside it. The index's scores and ranking equal a direct computation (each text alone through
transformers' AutoModel, no padding: mean of the last hidden states, cosine); through
`glmtune decide` the retrieval arm shows each prompt the index's top k and records the retriever;
a directory that is missing or holds no model, an unknown retriever, and the option without --docs
are refused in one sentence with nothing written.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertConfig

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.decide.documents import read_documents
from glmtune.decide.embeddings import EmbeddingIndex
from glmtune.decide.passages import Passages
from tests.decide.helpers import decision_of, run_cli, small_suite, trained_run, write_jsonl


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("embedder")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256)
    AutoModel.from_config(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER_DIR / name, directory / name)
    return directory


def _direct(directory, texts: list[str]) -> np.ndarray:
    """Each text's embedding computed alone (no batch, no padding), as the module docstring defines it."""
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModel.from_pretrained(directory, local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=256, return_tensors="pt")["input_ids"]
            mean = model(input_ids=ids).last_hidden_state[0].mean(dim=0)
            rows.append((mean / mean.norm()).numpy())
    return np.stack(rows)


def test_scores_and_ranking_equal_a_direct_computation(embedder, tmp_path):
    corpus = read_documents(write_documents(tmp_path / "docs", seed=0))
    texts = [chunk.text for chunk in corpus.chunks]
    index = EmbeddingIndex(embedder, texts)
    chunks = _direct(embedder, texts)
    for row in generate_doc_questions(seed=0)[:10]:
        question = row["messages"][0]["content"]
        scores = chunks @ _direct(embedder, [question])[0]
        hits = index.search(question, 3)
        assert [h.index for h in hits] == list(np.argsort(-scores, kind="stable")[:3])
        assert [h.score for h in hits] == pytest.approx([scores[h.index] for h in hits], abs=1e-5)
    assert len(index.search("zzzz", len(texts) + 5)) == len(texts)  # every chunk has a score


def test_the_retrieval_arm_shows_the_embedding_models_passages(embedder, shared_results, tmp_path):
    run_dir = trained_run(shared_results)
    write_documents(tmp_path / "docs", seed=0)
    questions = generate_doc_questions(seed=0)[:2]
    write_jsonl(tmp_path / "catalog.jsonl", questions)
    suite = small_suite(tmp_path, [{"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]}],
                        [{"metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5}])
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(run_dir / "hf"), "--docs",
                                    str(tmp_path / "docs"), "--passages", "2", "--retriever",
                                    f"embeddings:{embedder}", "--out", str(out), "--device", "cpu"])
    assert code == 1, stdout + stderr
    decision = decision_of(out)
    arm = decision["arms"][1]
    assert arm["retriever"] == f"embeddings:{embedder}" and "cosine of mean-pooled embeddings:" in arm["how"]
    passages = Passages(read_documents(tmp_path / "docs"), 2, EmbeddingIndex(
        embedder, [c.text for c in read_documents(tmp_path / "docs").chunks]), "embeddings")
    for example, row in zip(decision["scorecard"]["examples"], questions):
        expected = passages.for_question(row["messages"][0]["content"])
        assert [s["where"] for s in example["added"]["retrieval"]] == [s.chunk.where for s in expected]


@pytest.mark.parametrize("value, message", [
    ("embeddings:{tmp}/missing", "is not a directory"),
    ("embeddings:{tmp}", "no config.json in"),
    ("dense", "expected bm25 or embeddings:DIR"),
    ("embeddings:", "expected bm25 or embeddings:DIR"),
])
def test_a_retriever_that_cannot_be_used_is_refused(tmp_path, value, message):
    write_documents(tmp_path / "docs", seed=0)
    code, _, stderr = run_cli(["decide", str(tmp_path / "suite.yaml"), "--base", str(tmp_path), "--docs",
                               str(tmp_path / "docs"), "--retriever", value.format(tmp=tmp_path), "--out",
                               str(tmp_path / "out")])
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_the_retriever_without_documents_is_refused(embedder, tmp_path):
    code, _, stderr = run_cli(["decide", str(tmp_path / "suite.yaml"), "--base", str(tmp_path), "--retriever",
                               f"embeddings:{embedder}", "--out", str(tmp_path / "out")])
    assert code == 2 and "--retriever applies to the retrieval arm, which runs with --docs" in stderr, stderr
