"""Rollback triggers derived from each gate rule, merged per metric, and parsed from `--rollback`."""

from __future__ import annotations

import pytest

from glmtune.release.triggers import default_triggers, parse_trigger, resolve_triggers


def _metric(metric_id, higher, base, cand, unit="ratio"):
    return {"id": metric_id, "unit": unit, "higher_is_better": higher,
            "by_category": {"all": {"n": 10, "values": {"base": base, "candidate": cand}}}}


def _gate(metric, rule, threshold=None, passed=True, model="candidate", value=None, base=None):
    return {"name": f"{metric} {rule}", "metric": metric, "category": "all", "model": model, "rule": rule,
            "threshold": threshold, "value": value, "base_value": base, "passed": passed}


SCORECARD = {
    "metrics": [_metric("t/acc", True, 0.5, 0.8), _metric("t/loss", False, 2.0, 1.5, "nats_per_token"),
                _metric("t/fmt", False, 3.0, 0.0, "count"), _metric("g/loss", False, 2.0, 2.04, "nats_per_token")],
    "operations": {"candidate": {"p95_s": 0.5, "generated_tokens_per_s": 80.0}},
    "gates": [],
}


@pytest.mark.parametrize("gate, expression", [
    (_gate("t/acc", "improves", base=0.5), "t/acc < 0.72"),          # 0.8 - 10%: above the base
    (_gate("t/acc", "improves", base=0.5, threshold=0.25), "t/acc < 0.75"),  # the gate's bar: base + 0.25
    (_gate("t/acc", "min", 0.75), "t/acc < 0.75"),
    (_gate("t/acc", "no_regression", 0.1, base=0.5), "t/acc < 0.72"),
    (_gate("t/loss", "improves", base=2.0), "t/loss > 1.65"),         # lower is better: 1.5 + 10%
    (_gate("t/loss", "no_regression", 0.1, base=1.55), "t/loss > 1.65"),
    (_gate("t/loss", "max", 1.6), "t/loss > 1.6"),
    (_gate("t/fmt", "max", 0), "t/fmt > 0"),
    (_gate("g/loss", "max_increase", 0.05, base=2.0), "g/loss > 2.05"),
    (_gate("g/loss", "max_increase", 0.05, base=2.0, model=None), "g/loss > 2.05"),  # every candidate
    # A gate on an operations figure the metrics do not list: its rule gives the direction.
    (_gate("ops/latency/p95", "max", 1.0, value=0.5), "ops/latency/p95 > 0.55"),
])
def test_default_trigger_per_rule(gate, expression):
    scorecard = {**SCORECARD, "gates": [gate]}
    (trigger,) = resolve_triggers(scorecard, "candidate", [], 0.1)
    assert trigger["expression"] == expression and trigger["source"] == f"gate: {gate['name']}"


def test_defaults_merge_per_metric_and_skip_others():
    gates = [_gate("t/acc", "improves", base=0.5), _gate("t/acc", "min", 0.78),
             _gate("t/acc", "min", 0.1, model="candidate-merged"),  # another candidate's gate
             _gate("nowhere/x", "improves")]  # no direction and no value: nothing to derive
    (trigger,) = default_triggers({**SCORECARD, "gates": gates}, "candidate", 0.1)
    assert (trigger["op"], trigger["threshold"]) == ("<", 0.78)  # the tightest
    assert trigger["source"] == "gate: t/acc improves; t/acc min"


def test_parse_operations_and_categories():
    trigger = parse_trigger(" tokens_per_s < 40 ", SCORECARD, "candidate")
    assert (trigger["metric"], trigger["op"], trigger["threshold"], trigger["eval_value"]) == (
        "tokens_per_s", "<", 40.0, 80.0)
    assert parse_trigger("error_rate>=0.02", SCORECARD, "candidate")["eval_value"] is None
    assert parse_trigger("t/loss>1e1", SCORECARD, "candidate")["threshold"] == 10.0
    with pytest.raises(ValueError, match="t/acc is better higher"):
        parse_trigger("t/acc>=0.9", SCORECARD, "candidate")
    with pytest.raises(ValueError, match="not a rollback trigger"):
        parse_trigger("t/acc<nan", SCORECARD, "candidate")
