"""Rollback triggers: the thresholds, fixed before launch, at which a release is rolled back.

One trigger is one condition on a measured value; when it holds on live traffic, roll back:

    METRIC[@CATEGORY] OP NUMBER        OP: <  <=  >  >=

    tickets/task_success/exact<0.5            the eval metric (scorecard id), category "all"
    tickets/task_success/exact@tool_call<0.4  the same metric on one category
    p95_latency_s>2.0                         an operations signal (`OPERATIONS`)

METRIC is a metric id of the release's scorecard or an operations signal; CATEGORY one of
that metric's categories in the scorecard. The direction must be the bad one (a trigger
fires when a higher-is-better metric falls, `<`/`<=`, or a lower-is-better one rises,
`>`/`>=`), and a trigger must not already hold for the candidate's own evaluated value:
either would roll the release back at once. Nor may a trigger be true, or false, for every value
the metric can take (`UNIT_RANGES`: a ratio lies in [0, 1]; counts, losses, durations,
throughputs and memory sizes are never negative): `error_rate>-1` would fire at once and
`tickets/task_success/exact<0` never; either is refused in one sentence naming the trigger.

Defaults come from the eval's release gates on the released candidate: each gated metric
gets a trigger at the candidate's evaluated value moved by the margin (`--rollback-margin`,
relative, default 0.1) in the bad direction, or at the gate's own bar (a `min`/`max`
threshold, the base's value for `improves`/`no_regression`/`max_increase`) when that comes
first: production should never be worse than what the gate let through. Several gates on
one metric and category give one trigger, the tightest. A user trigger on the same metric
and category replaces the default. A default that the metric's range would leave unable to
fire (a lower-is-better ratio at 0.95 moved 10% up is 1.045) sits at the end of the range with
`>=`/`<=` instead (`>= 1`). A candidate already at the worst value its metric can take (a ratio
of 0 let through by a `min 0` gate, or released with failed gates) has no trigger on it that
could fire without firing at once: the metric gets none, and the release records and prints
which gated metric has none and why, rather than a trigger that could never fire.
"""

from __future__ import annotations

import math
import re
from typing import Any

# name -> (higher_is_better, unit, key in the scorecard's `operations[label]`, what)
OPERATIONS: dict[str, tuple[bool, str, str | None, str]] = {
    "p50_latency_s": (False, "seconds", "p50_s", "median latency per request"),
    "p95_latency_s": (False, "seconds", "p95_s", "95th-percentile latency per request"),
    "tokens_per_s": (True, "tokens_per_s", "generated_tokens_per_s", "generated tokens per second"),
    "peak_memory_gib": (False, "gib", "peak_memory_gib", "peak accelerator memory"),
    "error_rate": (False, "ratio", None, "share of requests that end in an infrastructure error"),
}
DEFAULT_MARGIN = 0.1
# unit -> (lowest, highest, what): the values a metric of that unit can take (another unit, or
# none, is unbounded: "nats" margins of a preference pair can be any number).
UNIT_RANGES: dict[str, tuple[float, float, str]] = {
    "ratio": (0.0, 1.0, "a ratio, between 0 and 1"),
    "count": (0.0, math.inf, "a count, never negative"),
    "seconds": (0.0, math.inf, "a duration, never negative"),
    "tokens_per_s": (0.0, math.inf, "a throughput, never negative"),
    "gib": (0.0, math.inf, "a memory size, never negative"),
    "nats_per_token": (0.0, math.inf, "a loss, never negative"),
}
_SYNTAX = re.compile(r"^\s*(?P<metric>[A-Za-z0-9_.\-/]+)(?:@(?P<category>[A-Za-z0-9_.\-]+))?\s*"
                     r"(?P<op><=|>=|<|>)\s*(?P<value>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_HOLDS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}
SYNTAX_HELP = "METRIC[@CATEGORY] OP NUMBER with OP one of < <= > >= (e.g. tickets/task_success/exact<0.5)"


def expression(trigger: dict[str, Any]) -> str:
    category = "" if trigger["category"] == "all" else f"@{trigger['category']}"
    return f"{trigger['metric']}{category} {trigger['op']} {trigger['threshold']:g}"


def value_range(unit: str | None) -> tuple[float, float, str]:
    """The lowest and highest value of a metric in `unit`, and what such a metric is."""
    return UNIT_RANGES.get(unit or "", (-math.inf, math.inf, "unbounded"))


def vacuous(metric: str, op: str, threshold: float, unit: str | None) -> str | None:
    """Why `METRIC OP THRESHOLD` is true for every value the metric can take, or for none (a
    clause for a message); None when some values make it true and others false. The condition
    is monotone in the value, so the two ends of the range decide."""
    if not math.isfinite(threshold):
        return f"{threshold:g} is not a finite number"
    lowest, highest, what = value_range(unit)
    at_lowest, at_highest = _HOLDS[op](lowest, threshold), _HOLDS[op](highest, threshold)
    if at_lowest and at_highest:
        return f"it is true for every value {metric} can take ({what}), so the release would be rolled back at once"
    if not (at_lowest or at_highest):
        return f"it is false for every value {metric} can take ({what}), so it could never roll the release back"
    return None


def _round(value: float) -> float:
    return float(f"{value:.6g}")  # 0.11249999999999999 -> 0.1125: thresholds people read and type


def _signal(scorecard: dict[str, Any], label: str, metric: str, category: str, option: str) -> dict[str, Any]:
    """What the manifest says about one measured signal; ValueError naming `option` if unknown."""
    if metric in OPERATIONS:
        higher_is_better, unit, key, _ = OPERATIONS[metric]
        if category != "all":
            raise ValueError(f"{option}: operations signal {metric} has no categories (drop @{category})")
        ops = (scorecard.get("operations") or {}).get(label) or {}
        return {"higher_is_better": higher_is_better, "unit": unit, "eval_value": ops.get(key) if key else None,
                "base_value": None}
    metrics = {m["id"]: m for m in scorecard.get("metrics", [])}
    if metric not in metrics:
        raise ValueError(f"{option}: unknown metric {metric}: not in the scorecard's metrics nor an operations "
                         f"signal ({', '.join(OPERATIONS)})")
    found = metrics[metric]
    by_category = found.get("by_category") or {}
    if category not in by_category:
        raise ValueError(f"{option}: metric {metric} has no category {category!r} in the scorecard (it has "
                         f"{', '.join(sorted(by_category)) or 'none'})")
    values = by_category[category].get("values") or {}
    return {"higher_is_better": bool(found.get("higher_is_better", True)), "unit": found.get("unit"),
            "eval_value": values.get(label), "base_value": values.get("base")}


def parse_trigger(text: str, scorecard: dict[str, Any], label: str) -> dict[str, Any]:
    """One `--rollback` expression, checked against the scorecard (see the module docstring)."""
    option = f"--rollback {text!r}"
    match = _SYNTAX.match(text)
    if not match:
        raise ValueError(f"{option}: not a rollback trigger; write {SYNTAX_HELP}")
    metric, category, op = match["metric"], match["category"] or "all", match["op"]
    threshold = float(match["value"])
    signal = _signal(scorecard, label, metric, category, option)
    bad = ("<", "<=") if signal["higher_is_better"] else (">", ">=")
    if op not in bad:
        better = "higher" if signal["higher_is_better"] else "lower"
        raise ValueError(f"{option}: {metric} is better {better}, so a rollback trigger fires when it "
                         f"{'falls' if signal['higher_is_better'] else 'rises'}: use {' or '.join(bad)}")
    why = vacuous(metric, op, threshold, signal["unit"])
    if why:
        raise ValueError(f"{option}: {why}")
    trigger = {"metric": metric, "category": category, "op": op, "threshold": threshold, **signal,
               "source": "--rollback"}
    value = signal["eval_value"]
    if value is not None and _HOLDS[op](value, threshold):
        raise ValueError(f"{option}: already holds for candidate {label!r}, which the eval measured at {value:g}: "
                         "the release would be rolled back at once")
    return trigger


def _gate_bar(gate: dict[str, Any], higher_is_better: bool) -> float | None:
    """The value past which the gate would have failed (None when the gate names none)."""
    rule, threshold, base = gate.get("rule"), gate.get("threshold"), gate.get("base_value")
    if rule in ("min", "max"):
        return threshold
    if base is None:
        return None
    slack = threshold or 0.0
    if rule == "improves":
        return base + slack if higher_is_better else base - slack
    if rule == "no_regression":
        return base - slack if higher_is_better else base + slack
    if rule == "max_increase":
        return base + slack
    if rule == "max_ratio_to_base":
        return base * slack
    return None


def _gate_signal(scorecard: dict[str, Any], label: str, gate: dict[str, Any], metric: str,
                 category: str) -> dict[str, Any] | None:
    """The gated signal; for a metric the scorecard does not list (an operations figure), what the
    gate itself says when its rule gives the direction; None when nothing can be derived."""
    try:
        return _signal(scorecard, label, metric, category, f"gate {gate.get('name')!r}")
    except ValueError:
        if gate.get("rule") not in ("min", "max", "max_increase", "max_ratio_to_base"):
            return None
        return {"higher_is_better": gate["rule"] == "min", "unit": None, "eval_value": gate.get("value"),
                "base_value": gate.get("base_value")}


def _default_condition(gate: dict[str, Any], signal: dict[str, Any], margin: float) -> tuple[str, float]:
    """The op and threshold of the trigger one gate gives: the margin or the gate's bar, whichever
    comes first, held inside the metric's range (at its end with `<=`/`>=`, where a strict
    comparison could never hold)."""
    value, hib = signal["eval_value"], signal["higher_is_better"]
    bound = value - margin * abs(value) if hib else value + margin * abs(value)
    bar = _gate_bar(gate, hib) if gate.get("passed") else None  # a failed gate's bar holds already
    if bar is not None:
        bound = max(bound, bar) if hib else min(bound, bar)
    lowest, highest, _ = value_range(signal["unit"])
    if hib and bound <= lowest:
        return "<=", lowest
    if not hib and bound >= highest:
        return ">=", highest
    return ("<" if hib else ">"), _round(bound)


def _tightest(a: tuple[str, float], b: tuple[str, float], hib: bool) -> tuple[str, float]:
    """Of two conditions on one metric, the one that fires first (at equal thresholds, `<=`/`>=`)."""
    if a[1] != b[1]:
        return max(a, b, key=lambda c: c[1]) if hib else min(a, b, key=lambda c: c[1])
    return a if a[0] in ("<=", ">=") else b


def default_triggers(scorecard: dict[str, Any], label: str, margin: float) -> list[dict[str, Any]]:
    """One trigger per metric and category the gates on `label` check (see the module docstring)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for gate in scorecard.get("gates", []):
        if gate.get("model") not in (label, None):  # None: the gate applies to every candidate
            continue
        metric, category = gate["metric"], gate.get("category") or "all"
        signal = _gate_signal(scorecard, label, gate, metric, category)
        if signal is None or signal["eval_value"] is None:
            continue  # no direction, or not measured: no value to hold production to
        condition = _default_condition(gate, signal, margin)
        key = (metric, category)
        if key in merged:
            old = merged[key]
            condition = _tightest(condition, (old["op"], old["threshold"]), signal["higher_is_better"])
            sources = f"{old['source']}; {gate.get('name')}"
        else:
            sources = f"gate: {gate.get('name')}"
        merged[key] = {"metric": metric, "category": category, "op": condition[0], "threshold": condition[1],
                       **signal, "source": sources}
    return list(merged.values())


def _unfireable(trigger: dict[str, Any], label: str) -> str | None:
    """Why a default trigger could never fire, or would fire at once (None when it can do its job)."""
    value = trigger["eval_value"]
    why = vacuous(trigger["metric"], trigger["op"], trigger["threshold"], trigger["unit"])
    if why is None and _HOLDS[trigger["op"]](value, trigger["threshold"]):
        why = (f"candidate {label!r}'s {value:g} is already the worst value {trigger['metric']} can take "
               f"({value_range(trigger['unit'])[2]}), so a trigger on it could only fire at once")
    return why


def resolve_triggers(scorecard: dict[str, Any], label: str, user: list[str],
                     margin: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The release's triggers: the gates' defaults, each replaced by a user trigger on the same key;
    and the gated metrics left without one, each with its gates and why (a default that could not
    fire without firing at once: the candidate is at the worst value its metric can take)."""
    if not (0.0 <= margin < 1.0) or math.isnan(margin):
        raise ValueError(f"--rollback-margin {margin}: must be in [0, 1) (a fraction of the evaluated value)")
    parsed = [parse_trigger(text, scorecard, label) for text in user]
    seen: dict[tuple[str, str], str] = {}
    for text, trigger in zip(user, parsed):
        key = (trigger["metric"], trigger["category"])
        if key in seen:
            raise ValueError(f"--rollback {text!r}: {trigger['metric']}@{trigger['category']} already has a "
                             f"trigger ({seen[key]!r}); give one per metric and category")
        seen[key] = text
    defaults, untriggered = [], []
    for trigger in default_triggers(scorecard, label, margin):
        if (trigger["metric"], trigger["category"]) in seen:
            continue
        why = _unfireable(trigger, label)
        if why is None:
            defaults.append(trigger)
        else:
            untriggered.append({"metric": trigger["metric"], "category": trigger["category"],
                                "source": trigger["source"], "reason": why})
    triggers = defaults + parsed
    for trigger in triggers:
        trigger["expression"] = expression(trigger)
    return triggers, untriggered
