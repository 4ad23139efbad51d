"""The bundled task's documents and the questions only they answer (glmtune/data/synthetic_docs.py,
`glmtune data synth --kind support_docs | support_doc_questions`): deterministic per seed, the
bundled copies under recipes/tiny are the generator's output, the questions pass the data
contract, and the CLI writes the folder in one step (replaced only with --overwrite)."""

from __future__ import annotations

import json
from pathlib import Path

from glmtune.data.contract import check_or_raise
from glmtune.data.sources import read_rows
from glmtune.data.synthetic import ISSUES, PRODUCTS
from glmtune.data.synthetic_docs import generate_doc_questions, generate_documents
from tests.decide.helpers import run_cli

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny"


def test_the_bundled_documents_and_questions_are_the_generators():
    bundled = {p.relative_to(TINY / "support_docs").as_posix(): p.read_text()
               for p in (TINY / "support_docs").rglob("*.md")}
    assert bundled == generate_documents(seed=0)
    lines = (TINY / "eval_support_json" / "doc_questions_seed0.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == generate_doc_questions(seed=0)


def test_every_triage_fact_and_planted_fact_is_in_the_documents():
    docs = generate_documents(seed=5)
    assert len(docs) == len(ISSUES) + 1 + len(PRODUCTS)
    for category, (severity, action, _) in ISSUES.items():
        assert f"has severity {severity}. Its next action is {action}." in docs[f"triage/{category}.md"]
    text = "\n".join(docs.values())
    questions = generate_doc_questions(seed=5)
    assert len(questions) == 5 * len(PRODUCTS)
    for row in questions:
        assert row["required_facts"][0] in text and row["required_facts"][0] not in row["forbidden_claims"]
        assert not any(claim in row["required_facts"][0] for claim in row["forbidden_claims"])
    assert generate_documents(seed=5) == docs and generate_documents(seed=6) != docs


def test_the_questions_pass_the_data_contract(tmp_path):
    code, stdout, _ = run_cli(["data", "synth", str(tmp_path / "q.jsonl"), "--kind", "support_doc_questions"])
    assert code == 0 and "wrote 30 question row(s)" in stdout
    assert len(check_or_raise(read_rows(tmp_path / "q.jsonl"))) == 30


def test_the_cli_writes_the_folder_and_replaces_only_its_own(tmp_path):
    out = tmp_path / "docs"
    assert run_cli(["data", "synth", str(out), "--kind", "support_docs", "--seed", "2"])[0] == 0
    assert {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*.md")} == generate_documents(seed=2)
    code, _, stderr = run_cli(["data", "synth", str(out), "--kind", "support_docs"])
    assert code == 2 and "already exists and is not empty; pass --overwrite" in stderr
    assert run_cli(["data", "synth", str(out), "--kind", "support_docs", "--overwrite"])[0] == 0
    assert (out / "catalog" / "payflow.md").read_text() == generate_documents(seed=0)["catalog/payflow.md"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("my notes")
    code, _, stderr = run_cli(["data", "synth", str(tmp_path / "mine"), "--kind", "support_docs", "--overwrite"])
    assert code == 2 and (tmp_path / "mine" / "notes.md").read_text() == "my notes"
    code, _, stderr = run_cli(["data", "synth", str(out), "--kind", "support_docs", "--rows", "3"])
    assert code == 2 and "--rows: --kind support_docs is a fixed set per seed" in stderr
