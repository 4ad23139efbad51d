"""Row scores into the scorecard's `metrics`, `fields` and `examples`.

A metric's value for a category is the mean (ratios, seconds) or the sum (counts) of the row
values that are not None, n the number of those rows; None when there are none. Categories are
"all" plus, when a set holds more than one category, each category. `delta` is a label's value
minus the base's (None where either is None).

An example passes when no scorer of its set records a failure and its request did not fail;
a failed request (`ModelOutput.error`: its prompt, generation or tool loop raised) is scored
on the text it has (none: an empty answer), and its reason comes first in `failures`.
"""

from __future__ import annotations

from typing import Any

from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore

# scores[label][set name][scorer name] -> one RowScore per row of the set
Scores = dict[str, dict[str, dict[str, list[RowScore]]]]


def _reduce(values: list[float], how: str) -> float | None:
    if not values:
        return None
    return sum(values) if how == "sum" else sum(values) / len(values)


def _entry(values: dict[str, float | None], n: int, labels: list[str]) -> dict[str, Any]:
    base = values.get("base")
    delta = {label: (values[label] - base if values[label] is not None and base is not None else None)
             for label in labels if label != "base"}
    return {"n": n, "values": values, "delta": delta}


def metric_record(metric_id: str, definition: MetricDef, by_category: dict[str, Any]) -> dict[str, Any]:
    set_name, scorer, name = metric_id.split("/")
    return {"id": metric_id, "set": set_name, "scorer": scorer, "name": name, "description": definition.description,
            "unit": definition.unit, "higher_is_better": definition.higher_is_better, "by_category": by_category}


def set_metrics(set_name: str, rows: list[EvalRow], scorers: list, scores: Scores, labels: list[str]) -> list[dict]:
    categories = sorted({row.category for row in rows})
    groups = {"all": list(range(len(rows)))}
    if len(categories) > 1:
        groups.update({c: [i for i, row in enumerate(rows) if row.category == c] for c in categories})
    records = []
    for scorer in scorers:
        for definition in scorer.metrics(scorer.options):
            by_category = {}
            for category, indices in groups.items():
                values, n = {}, 0
                for label in labels:
                    row_values = [scores[label][set_name][scorer.name][i].values[definition.name] for i in indices]
                    present = [v for v in row_values if v is not None]
                    values[label] = _reduce(present, definition.reduce)
                    n = max(n, len(present))
                by_category[category] = _entry(values, n, labels)
            records.append(metric_record(f"{set_name}/{scorer.name}/{definition.name}", definition, by_category))
    return records


def single_metric(metric_id: str, definition: MetricDef, values: dict[str, float | None], n: int,
                  labels: list[str]) -> dict:
    """A metric measured once per model (general text loss, operations): category "all" only."""
    return metric_record(metric_id, definition, {"all": _entry(values, n, labels)})


def field_records(set_name: str, rows: list[EvalRow], scores: Scores, labels: list[str]) -> list[dict]:
    """Per-field accuracy of a task_success set, fields in first-seen order."""
    names: dict[str, None] = {}
    for score in scores[labels[0]][set_name]["task_success"]:
        names.update(dict.fromkeys(score.fields))
    out = []
    for name in names:
        values, n = {}, 0
        for label in labels:
            marks = [s.fields[name] for s in scores[label][set_name]["task_success"] if name in s.fields]
            values[label] = sum(marks) / len(marks) if marks else None
            n = len(marks)
        out.append({"set": set_name, "field": name, "n": n, "values": values})
    return out


def example_records(set_name: str, rows: list[EvalRow], outputs: dict[str, list[ModelOutput]], scores: Scores,
                    labels: list[str], pairs: bool = False) -> list[dict]:
    """Every row's record; `pairs` (a preference set): each model's `preference` (the pair's
    log-probabilities, margin and implicit margin; null when not computed) beside its summary text."""
    records = []
    for i, row in enumerate(rows):
        per_model = {}
        for label in labels:
            out = outputs[label][i]
            failures = list(dict.fromkeys([out.error] * (out.error is not None) +
                                          [f for scorer_scores in scores[label][set_name].values()
                                           for f in scorer_scores[i].failures]))
            per_model[label] = {"text": out.text, "transcript": out.transcript,
                                "tool_calls": [c.to_json() for c in out.tool_calls],
                                "latency_s": round(out.latency_s, 6), "generated_tokens": out.generated_tokens,
                                "finish": out.finish, "error": out.error, "passed": not failures,
                                "failures": failures}
            if pairs:
                per_model[label]["preference"] = out.preference.to_json() if out.preference is not None else None
        reference = row.reference
        if reference is None and row.reference_calls:
            reference = "; ".join(f"calls {c['name']}({c['arguments']})" for c in row.reference_calls)
        records.append({"set": set_name, "id": row.id, "category": row.category, "origin": row.origin,
                        "prompt": row.last_user_text, "reference": reference, "outputs": per_model})
    return records
