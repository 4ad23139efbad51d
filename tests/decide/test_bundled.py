"""The bundled decide suite (recipes/tiny/eval_decide_support_json.yaml) loads and is one decide
accepts: every gate a target any arm can meet, its catalog set the generated questions."""

from __future__ import annotations

from glmtune.decide.run import _check_suite
from glmtune.eval.suite import load_suite


def test_the_bundled_decide_suite():
    suite = load_suite("tiny/eval_decide_support_json")
    _check_suite(suite)
    assert [s.name for s in suite.sets] == ["tickets", "catalog", "refusal"]
    assert {g.rule for g in suite.file.gates} <= {"min", "max", "no_regression"}
    assert suite.sets[1].path.name == "doc_questions_seed0.jsonl"
