"""Rollback triggers derived from each gate rule, merged per metric, and parsed from `--rollback`."""

from __future__ import annotations

import re

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
    (trigger,), _ = resolve_triggers(scorecard, "candidate", [], 0.1)
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


# A trigger true for every value its metric can take fires at once; one false for all never fires.
@pytest.mark.parametrize("text, why", [
    ("error_rate>-1", "true for every value error_rate can take (a ratio, between 0 and 1)"),
    ("error_rate>=0", "true for every value"),
    ("error_rate>1", "false for every value error_rate can take (a ratio"),
    ("error_rate>=1.5", "false for every value"),
    ("t/acc<0", "false for every value t/acc can take (a ratio"),
    ("t/acc<=-0.5", "false for every value"),
    ("t/acc<1.5", "true for every value"),
    ("t/loss>-0.1", "true for every value t/loss can take (a loss, never negative)"),
    ("t/fmt>=0", "true for every value t/fmt can take (a count, never negative)"),
    ("p95_latency_s>-1", "(a duration, never negative)"),
    ("peak_memory_gib>=-0.5", "(a memory size, never negative)"),
    ("tokens_per_s<0", "false for every value tokens_per_s can take (a throughput"),
    ("tokens_per_s<=-1", "false for every value"),
    ("t/acc<1e999", "inf is not a finite number"),
    ("t/margin<-1e999", "-inf is not a finite number"),
])
def test_a_trigger_always_or_never_true_is_refused(text, why):
    scorecard = {**SCORECARD, "metrics": SCORECARD["metrics"] + [_metric("t/margin", True, 0.1, 0.4, "nats")]}
    with pytest.raises(ValueError, match=re.escape(f"--rollback {text!r}: ") + ".*" + re.escape(why)):
        resolve_triggers(scorecard, "candidate", [text], 0.1)


@pytest.mark.parametrize("text", ["error_rate>=1", "error_rate>0", "t/acc<=0", "t/fmt>0", "tokens_per_s<=0",
                                  "t/margin<-5"])
def test_a_trigger_at_the_end_of_its_range_can_fire(text):
    scorecard = {**SCORECARD, "metrics": SCORECARD["metrics"] + [_metric("t/margin", True, 0.1, 0.4, "nats")]}
    (trigger,), _ = resolve_triggers(scorecard, "candidate", [text], 0.1)
    assert trigger["source"] == "--rollback"


@pytest.mark.parametrize("metric, gate, expression", [
    # A lower-is-better ratio at 0.95: 10% up is past 1 and the gate's bar is 1: `> 1` could never fire.
    (_metric("t/err", False, 0.5, 0.95), _gate("t/err", "max", 1.0), "t/err >= 1"),
    (_metric("t/err", False, 0.5, 0.95), _gate("t/err", "max", 0.5, passed=False), "t/err >= 1"),
    # Unbounded ("nats"): a margin at 0 may fall below it.
    (_metric("t/margin", True, 0.0, 0.0, "nats"), _gate("t/margin", "min", 0.0), "t/margin < 0"),
])
def test_a_default_trigger_stays_inside_the_metric_range(metric, gate, expression):
    scorecard = {**SCORECARD, "metrics": [metric], "gates": [gate]}
    (trigger,), _ = resolve_triggers(scorecard, "candidate", [], 0.1)
    assert trigger["expression"] == expression


@pytest.mark.parametrize("metric, gate, worst", [
    (_metric("t/acc", True, 0.0, 0.0), _gate("t/acc", "min", 0.0), "0"),    # `t/acc < 0` could never fire
    (_metric("t/acc", True, 0.5, 0.0), _gate("t/acc", "min", 0.5, passed=False), "0"),  # --allow-failed-gates
    (_metric("t/err", False, 0.5, 1.0), _gate("t/err", "max", 1.0), "1"),   # `t/err > 1` could never fire
])
def test_a_candidate_at_the_worst_value_gets_no_trigger_and_the_reason(metric, gate, worst):
    scorecard = {**SCORECARD, "metrics": [metric], "gates": [gate, _gate("t/fmt", "max", 0)]}
    scorecard["metrics"].append(SCORECARD["metrics"][2])
    triggers, untriggered = resolve_triggers(scorecard, "candidate", [], 0.1)
    assert [t["expression"] for t in triggers] == ["t/fmt > 0"]
    assert untriggered == [{"metric": metric["id"], "category": "all", "source": f"gate: {gate['name']}",
                            "reason": f"candidate 'candidate''s {worst} is already the worst value {metric['id']} "
                                      f"can take (a ratio, between 0 and 1), so a trigger on it could only fire "
                                      "at once"}]
