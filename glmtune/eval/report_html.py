"""The self-contained HTML scorecard: `render_html(scorecard) -> str`.

The page is one file that opens from disk with no network: the stylesheet
(`report_html.css`), the script (`report_html.js`) and the charts (SVG drawn by
`report_charts.py`) are inlined. Its Content-Security-Policy allows nothing to be fetched and
only this module's own script and stylesheet to run, by hash: model outputs are escaped by
Jinja's autoescape, and even a piece of markup that slipped through could not execute. Before
that, every string of the scorecard (keys too: labels and categories are keys) has its control
characters and bidi overrides shown escaped (`glmtune.io.escape.visible`), so an answer cannot
reorder the text around it; the page holds no JSON inside a <script> (the script's data are the
rows' autoescaped `data-*` attributes).

Sections: header (suite, models with sources and fingerprints, decoding, overall PASS/FAIL),
release gates, charts (each metric per category, per-field accuracy, latency per model), the
metrics table with deltas, and a failure browser over `examples` that filters by set,
category, model and pass/fail, with a text search (the script only shows and hides rows the
server rendered).

The input is the `glmtune.scorecard/1` dict (docs: /work/handoff/eval_interface.md, written by
`glmtune eval`). Any float may be None and optional sections may be missing; both render as
"—" or are left out.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections import Counter
from pathlib import Path

import jinja2

from glmtune.eval.report_charts import delta_class, fmt_delta, fmt_value, grouped_bars, latency_boxes
from glmtune.io.escape import visible

FORMAT = "glmtune.scorecard/1"
_HERE = Path(__file__).parent


@functools.lru_cache(maxsize=1)
def _assets() -> tuple[jinja2.Template, str, str]:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_HERE), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    css = (_HERE / "report_html.css").read_text(encoding="utf-8")
    js = (_HERE / "report_html.js").read_text(encoding="utf-8")
    # The hashes below cover these exact bytes; a closing tag inside would end the element early.
    assert "</style" not in css.lower() and "</script" not in js.lower()
    return env.get_template("report_html.jinja"), css, js


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def _short_hash(value) -> str:
    return str(value)[:12] if value else "—"


def _threshold_text(rule: str | None, threshold, unit: str | None) -> str:
    """The rule as a reader states it, e.g. `≥ 80.0%`, `improves on base by > 1.0 pp`."""
    amount = None if threshold is None else (fmt_delta(threshold, unit).lstrip("+−±"))
    if rule == "min":
        return f"≥ {fmt_value(threshold, unit)}"
    if rule == "max":
        return f"≤ {fmt_value(threshold, unit)}"
    if rule == "max_increase":
        return f"increase over base ≤ {amount}"
    if rule == "max_ratio_to_base":
        return f"≤ {threshold:g} × base"
    if rule == "improves":
        return "improves on base" + (f" by > {amount}" if threshold else "")
    if rule == "no_regression":
        return "no regression vs base" + (f" (tolerance {amount})" if threshold else "")
    return str(rule)


def _categories(by_category: dict) -> list[str]:
    """`all` first, the rest in the order the scorecard lists them."""
    return (["all"] if "all" in by_category else []) + [c for c in by_category if c != "all"]


def _metric_sections(metrics: list[dict], set_order: list[str], labels: list[str], candidates: list[str]):
    by_set: dict[str, list[dict]] = {}
    for metric in metrics:
        by_set.setdefault(str(metric.get("set") or metric.get("id", "?").split("/")[0]), []).append(metric)
    ordered = [s for s in set_order if s in by_set] + [s for s in by_set if s not in set_order]
    sections = []
    for set_name in ordered:
        charts, rows = [], []
        for metric in by_set[set_name]:
            unit, hib = metric.get("unit"), metric.get("higher_is_better")
            by_cat = metric.get("by_category") or {}
            cats = _categories(by_cat)
            groups = [(c, (by_cat[c] or {}).get("n"), (by_cat[c] or {}).get("values") or {}) for c in cats]
            direction = "" if hib is None else " (higher is better)" if hib else " (lower is better)"
            charts.append({"id": f"chart-{len(sections)}-{len(charts)}", "metric": metric.get("id", "?"),
                           "description": (metric.get("description") or "") + direction,
                           "svg": grouped_bars(chart_id=f"chart-{len(sections)}-{len(charts)}",
                                               title=f"{metric.get('id')}: {metric.get('description') or ''}",
                                               groups=groups, models=labels, unit=unit, filter_set=set_name)})
            why = metric.get("not_available") or {}  # "not available from this engine: ..." -> its first clause
            for c in cats:
                cell = by_cat[c] or {}
                values, deltas = cell.get("values") or {}, cell.get("delta") or {}
                rows.append({"metric": metric.get("id", "?"), "first": c == cats[0], "span": len(cats),
                             "category": c, "n": cell.get("n"), "unit": unit or "",
                             "vals": [fmt_value(values.get(lab), unit) if lab not in why
                                      else f"n/a ({str(why[lab]).split(':')[0]})" for lab in labels],
                             "deltas": [(fmt_delta(deltas.get(lab), unit), delta_class(deltas.get(lab), hib))
                                        for lab in candidates]})
        sections.append({"set": set_name, "charts": charts, "rows": rows})
    return sections


def _field_chart(fields: list[dict], labels: list[str]):
    if not fields:
        return None
    many_sets = len({f.get("set") for f in fields}) > 1
    groups = [((f"{f.get('set')}: " if many_sets else "") + str(f.get("field")), f.get("n"), f.get("values") or {})
              for f in fields]
    return grouped_bars(chart_id="chart-fields", title="Per-field accuracy", groups=groups, models=labels, unit="ratio")


def endpoint_faults(endpoint: dict | None) -> str:
    """An endpoint model's request accounting in a few words ("" for a local model)."""
    if not endpoint:
        return ""
    failed = ", ".join(f"{kind} x{n}" for kind, n in endpoint.get("failures", {}).items())
    return (f" ({endpoint.get('api')}; {endpoint.get('http_requests')} HTTP requests, {endpoint.get('retries')} "
            f"retries, {endpoint.get('failed_requests')} failed{': ' + failed if failed else ''})")


def _operations(operations: dict, labels: list[str]):
    present = [lab for lab in labels if lab in operations] + [lab for lab in operations if lab not in labels]
    if not present:
        return None, []
    color = {lab: i for i, lab in enumerate(labels)}
    rows = [(lab, color.get(lab, 3), list((operations[lab] or {}).get("latency_s") or []),
             (operations[lab] or {}).get("p50_s"), (operations[lab] or {}).get("p95_s")) for lab in present]
    table = []
    for lab in present:
        op = operations[lab] or {}
        table.append({"label": lab, "color": color.get(lab, 3), "requests": fmt_value(op.get("requests"), "count"),
                      "p50": fmt_value(op.get("p50_s"), "seconds"), "p95": fmt_value(op.get("p95_s"), "seconds"),
                      "tokens": fmt_value(op.get("generated_tokens"), "count"),
                      # serving cost: a model run here counts them; an endpoint's engine does not say
                      "parameters": fmt_value(op.get("parameters"), "count"),
                      "active": fmt_value(op.get("active_parameters"), "count"),
                      "tps": fmt_value(op.get("generated_tokens_per_s"), "tokens_per_s"),
                      "memory": fmt_value(op.get("peak_memory_gib"), "gib"),
                      "device": (op.get("device") or "—") + endpoint_faults(op.get("endpoint"))})
    return latency_boxes(chart_id="chart-latency", rows=rows), table


def _examples(examples: list[dict], labels: list[str], candidates: list[str]):
    out = []
    for i, ex in enumerate(examples):
        outputs = ex.get("outputs") or {}
        cells, results = [], {}
        for m, lab in enumerate(labels):
            o = outputs.get(lab)
            if o is None:
                cells.append({"label": lab, "color": m, "present": False})
                continue
            results[lab] = o.get("passed")
            calls = [{"name": c.get("name") or "?", "ok": c.get("ok"), "error": c.get("error"),
                      "result": (c.get("result") if c.get("result") is None or isinstance(c.get("result"), str)
                                 else json.dumps(c.get("result"), ensure_ascii=False, sort_keys=True)),
                      "arguments": json.dumps(c.get("arguments"), ensure_ascii=False, sort_keys=True)}
                     for c in (o.get("tool_calls") or [])]
            cells.append({"label": lab, "color": m, "present": True, "passed": o.get("passed"),
                          "text": o.get("text"), "transcript": o.get("transcript"), "tool_calls": calls,
                          "latency": fmt_value(o.get("latency_s"), "seconds"),
                          "failures": [str(f) for f in (o.get("failures") or [])]})
        out.append({"index": i, "set": str(ex.get("set") or ""), "id": str(ex.get("id") or f"#{i + 1}"),
                    "category": str(ex.get("category") or ""), "prompt": ex.get("prompt"),
                    "reference": ex.get("reference"), "cells": cells,
                    "results": json.dumps(results, ensure_ascii=False)})
    sets = Counter(e["set"] for e in out)
    cats = Counter(e["category"] for e in out)
    return out, sorted(sets.items()), sorted(cats.items())


def _visible_tree(value):
    """`value` with every string in it (dict keys included) passed through `visible`."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {_visible_tree(k): _visible_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_visible_tree(v) for v in value]
    return value


def render_html(scorecard: dict, preface: dict | None = None) -> str:
    """The report page for one scorecard dict (format `glmtune.scorecard/1`), as a string.
    `preface`: a section shown first, {"title", "paragraphs": [text], "tables": [{"caption",
    "columns", "rows"}]} (`glmtune decide`'s verdict), every string escaped as the scorecard's.

    Raises:
        ValueError: the dict is not a `glmtune.scorecard/1` scorecard.
    """
    if not isinstance(scorecard, dict) or scorecard.get("format") != FORMAT:
        got = scorecard.get("format") if isinstance(scorecard, dict) else type(scorecard).__name__
        raise ValueError(f"scorecard: format {got!r} is not {FORMAT!r}")
    template, css, js = _assets()
    scorecard = _visible_tree(scorecard)
    suite = scorecard.get("suite") or {}
    models = [m for m in (scorecard.get("models") or []) if isinstance(m, dict)]
    labels = [str(m.get("label")) for m in models]
    candidates = [str(m.get("label")) for m in models if m.get("role") != "base"]
    units = {m.get("id"): m.get("unit") for m in scorecard.get("metrics") or []}
    gates = []
    for g in scorecard.get("gates") or []:
        unit = units.get(g.get("metric"))
        gates.append({**g, "rule_text": _threshold_text(g.get("rule"), g.get("threshold"), unit),
                      "value_text": fmt_value(g.get("value"), unit), "base_text": fmt_value(g.get("base_value"), unit)})
    set_order = [str(s.get("name")) for s in suite.get("sets") or []]
    latency_svg, ops_table = _operations(scorecard.get("operations") or {}, labels)
    examples, set_counts, cat_counts = _examples(scorecard.get("examples") or [], labels, candidates)
    glm = scorecard.get("glmtune") or {}
    return template.render(
        css=jinja2.utils.markupsafe.Markup(css), js=jinja2.utils.markupsafe.Markup(js),
        csp=f"default-src 'none'; script-src {_csp_hash(js)}; style-src {_csp_hash(css)}; img-src data:; "
            "base-uri 'none'; form-action 'none'",
        suite=suite, passed=scorecard.get("passed"), created=scorecard.get("created") or "—",
        glmtune_version=glm.get("version") or "—", glmtune_commit=_short_hash(glm.get("commit")),
        decoding=list((scorecard.get("decoding") or {}).items()),
        prompt=[(k, v) for k, v in (scorecard.get("prompt") or {}).items()],
        models=[{**m, "label": labels[i], "color": i,
                 "fingerprint": list((m.get("fingerprint") or {}).items())} for i, m in enumerate(models)],
        labels=labels, candidates=candidates, gates=gates,
        compared=[str(m.get("label")) for m in models if m.get("role") == "compare"],
        gates_failed=sum(1 for g in gates if g.get("passed") is False),
        sections=_metric_sections(scorecard.get("metrics") or [], set_order, labels, candidates),
        field_chart=_field_chart(scorecard.get("fields") or [], labels),
        latency_chart=latency_svg, ops_table=ops_table,
        examples=examples, set_counts=set_counts, cat_counts=cat_counts, short=_short_hash,
        preface=_visible_tree(preface) if preface else None,
    )
