"""Gate arithmetic: each rule, both metric directions, thresholds, nulls, categories, models."""

from __future__ import annotations

import pytest

from glmtune.eval.gates import check, evaluate_gates
from glmtune.eval.suite import GateConfig


@pytest.mark.parametrize("rule, value, base, threshold, higher, passed", [
    ("improves", 0.2, 0.1, None, True, True),
    ("improves", 0.1, 0.1, None, True, False),          # equal is not an improvement
    ("improves", 0.15, 0.1, 0.1, True, False),          # by more than the margin
    ("improves", 6.0, 8.0, None, False, True),          # a loss going down improves
    ("improves", 8.0, 8.0, 0.0, False, False),
    ("no_regression", 0.5, 0.5, None, True, True),
    ("no_regression", 0.4, 0.5, None, True, False),
    ("no_regression", 0.45, 0.5, 0.05, True, True),      # within the allowed margin
    ("no_regression", 2.1, 2.0, None, False, False),     # a lower-is-better count went up
    ("min", 0.9, None, 0.9, True, True),
    ("min", 0.89, None, 0.9, True, False),
    ("max", 0.0, None, 0.0, False, True),
    ("max", 1.0, None, 0.0, False, False),
    ("max_increase", 8.4, 8.0, 0.5, False, True),
    ("max_increase", 8.6, 8.0, 0.5, False, False),
    ("max_increase", 7.0, 8.0, 0.0, False, True),
])
def test_rules(rule, value, base, threshold, higher, passed):
    assert check(rule, value, base, threshold, higher)[0] is passed


def _metric(values_all, values_a=None, higher=True):
    by_category = {"all": {"n": 4, "values": values_all}}
    if values_a is not None:
        by_category["a"] = {"n": 2, "values": values_a}
    return {"id": "s/x/m", "higher_is_better": higher, "by_category": by_category}


def test_every_candidate_category_and_nulls():
    metrics = [_metric({"base": 0.5, "candidate": 0.75, "candidate-merged": 0.25}, {"base": 0.5, "candidate": 0.0,
                                                                                   "candidate-merged": 1.0})]
    results = evaluate_gates([GateConfig("s/x/m", "no_regression")], metrics, ["candidate", "candidate-merged"])
    assert [(r["model"], r["passed"]) for r in results] == [("candidate", True), ("candidate-merged", False)]
    assert results[1]["message"] == "candidate-merged 0.250 vs base 0.500: regressed by 0.250"
    assert (results[1]["value"], results[1]["base_value"], results[1]["name"]) == (0.25, 0.5, "s/x/m no_regression")
    only_a = evaluate_gates([GateConfig("s/x/m", "improves", category="a", model="candidate-merged")], metrics,
                            ["candidate", "candidate-merged"])
    assert [(r["model"], r["passed"], r["category"]) for r in only_a] == [("candidate-merged", True, "a")]
    missing = evaluate_gates([GateConfig("s/x/m", "min", threshold=0.1, category="zzz")], metrics, ["candidate"])
    assert not missing[0]["passed"] and "no rows in category 'zzz'" in missing[0]["message"]
    null = evaluate_gates([GateConfig("s/x/m", "max", threshold=1.0)], [_metric({"base": 1.0, "candidate": None})],
                          ["candidate"])
    assert not null[0]["passed"] and "not measurable (null)" in null[0]["message"]
    null_base = evaluate_gates([GateConfig("s/x/m", "max_increase", threshold=1.0)],
                               [_metric({"base": None, "candidate": 1.0})], ["candidate"])
    assert not null_base[0]["passed"] and "the base's value is not measurable" in null_base[0]["message"]
    assert evaluate_gates([GateConfig("s/x/m", "max", threshold=1.0)], [_metric({"base": None, "candidate": 1.0})],
                          ["candidate"])[0]["passed"]  # min/max do not read the base
