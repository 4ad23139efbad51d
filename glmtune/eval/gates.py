"""Release gates: each a rule over one metric's value for one category, per candidate model.

    improves       candidate better than the base by more than `threshold` (default 0): for a
                   higher-is-better metric candidate - base > t, else base - candidate > t
    no_regression  candidate not worse than the base by more than `threshold` (default 0):
                   candidate >= base - t (higher is better), candidate <= base + t (lower is better)
    min / max      candidate >= threshold / candidate <= threshold
    max_increase   candidate - base <= threshold (loss, latency: lower-is-better budgets)
    max_ratio_to_base  candidate <= threshold x base, both measured in the same run (latency on an
                   unknown or shared machine: a ratio holds where an absolute service level cannot)

A gate names a metric id, a category (default "all") and a model label (default: every
candidate, one result each). A value that is None (not measurable, e.g. peak memory where no
measure exists, or a category with no rows) fails the gate and says so: a gate never passes
for lack of data.
"""

from __future__ import annotations

from typing import Any

from glmtune.eval.suite import GateConfig


def _fmt(value: float | None) -> str:
    if value is None:
        return "null"
    if float(value).is_integer() and abs(value) < 1e6:
        return f"{value:.0f}"  # counts, and round thresholds
    return f"{value:.4g}" if abs(value) >= 1e4 or abs(value) < 1e-3 else f"{value:.3f}"


def gate_name(gate: GateConfig) -> str:
    threshold = f" {gate.threshold:g}" if gate.threshold is not None else ""
    category = f" [{gate.category}]" if gate.category != "all" else ""
    return gate.name or f"{gate.metric}{category} {gate.rule}{threshold}"


def check(rule: str, value: float, base: float | None, threshold: float | None, higher_is_better: bool
          ) -> tuple[bool, str]:
    """(passed, the comparison as text) of one rule; base is None only for min/max."""
    t = threshold if threshold is not None else 0.0
    if rule == "min":
        return value >= t, f"{_fmt(value)} {'>=' if value >= t else '<'} {_fmt(t)}"
    if rule == "max":
        return value <= t, f"{_fmt(value)} {'<=' if value <= t else '>'} {_fmt(t)}"
    gain = value - base if higher_is_better else base - value  # > 0: the candidate is better
    if rule == "improves":
        passed = gain > t
        margin = f" by more than {_fmt(t)}" if t else ""
        verb = "improves on" if passed else "does not improve on"
        return passed, f"{_fmt(value)} {verb} base {_fmt(base)}{margin}"
    if rule == "no_regression":
        passed = gain >= -t
        allowed = f" (allowed {_fmt(t)})" if t else ""
        return passed, (f"{_fmt(value)} vs base {_fmt(base)}: " +
                        ("no regression" if gain >= 0 else f"{'within' if passed else 'regressed by'} {_fmt(-gain)}")
                        + allowed)
    if rule == "max_ratio_to_base":
        return _ratio_to_base(value, base, t)
    assert rule == "max_increase", rule
    increase = value - base
    relation = "<=" if increase <= t else ">"
    return increase <= t, f"{_fmt(value)} - base {_fmt(base)} = {_fmt(increase)} {relation} {_fmt(t)}"


def _ratio_to_base(value: float, base: float, t: float) -> tuple[bool, str]:
    """candidate / base <= t; a base of 0 (or below) gives no ratio, and the gate fails saying so."""
    if base <= 0:
        return False, f"{_fmt(value)} vs base {_fmt(base)}: no ratio to a base of {_fmt(base)}"
    ratio = value / base
    relation = "<=" if ratio <= t else ">"
    return ratio <= t, f"{_fmt(value)} / base {_fmt(base)} = {ratio:.2f} x base {relation} {t:g} x"


def evaluate_gates(gates: list[GateConfig], metrics: list[dict[str, Any]], candidates: list[str]) -> list[dict]:
    """The scorecard's `gates`: one entry per gate and candidate model it applies to."""
    by_id = {m["id"]: m for m in metrics}
    results = []
    for gate in gates:
        metric = by_id[gate.metric]  # the suite checked the id
        entry = metric["by_category"].get(gate.category)
        for label in [gate.model] if gate.model else candidates:
            value = entry["values"].get(label) if entry else None
            base = entry["values"].get("base") if entry else None
            needs_base = gate.rule not in ("min", "max")
            if entry is None:
                passed, text = False, f"no rows in category {gate.category!r}"
            elif value is None or (needs_base and base is None):
                missing = "base" if value is not None else label
                why = (metric.get("not_available") or {}).get(missing)  # an engine without prompt log-probabilities
                passed, text = False, f"{'the ' * (missing == 'base')}{missing}'s value is " + (
                    f"{why.split(':')[0]} (null)" if why else "not measurable (null)")
            else:
                passed, text = check(gate.rule, value, base, gate.threshold, metric["higher_is_better"])
            results.append({"name": gate_name(gate), "metric": gate.metric, "category": gate.category, "model": label,
                            "rule": gate.rule, "threshold": gate.threshold, "value": value, "base_value": base,
                            "passed": passed, "message": f"{label} {text}"})
    return results
