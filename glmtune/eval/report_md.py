"""scorecard.md: the scorecard as Markdown for a terminal, a pull request or a release note.

Sections: the verdict and the gates, the models, every metric by category (each model's value,
the delta from the base, n), per-field accuracy, the domain text against the general text (when the
suite has a domain set: the held-out domain perplexity and loss beside the general-text loss), operations, and the failures of each candidate
listed beside the reference and the base's answer (the first `max_failures` per set).

Every string from the scorecard (answers, prompts, categories, labels, sources, gate names and
messages, notes) goes through `glmtune.io.escape.md_text`: shown as written, it
cannot split a table row, clear a terminal that `cat`s the file, or become HTML, a link or a
verdict in bold.
"""

from __future__ import annotations

from typing import Any

from glmtune.io.escape import md_text


def _v(value: float | None, unit: str | None = None) -> str:
    if value is None:
        return "—"
    if unit == "ratio":
        return f"{value:.1%}"
    if unit == "count":
        return f"{value:g}"
    return f"{value:.4g}"


def _d(value: float | None, unit: str | None) -> str:
    if value is None:
        return "—"
    if unit == "ratio":
        return f"{value * 100:+.1f} pt"
    return f"{value:+.4g}"


def _cell(text: Any, limit: int = 160) -> str:
    """An untrusted string as one table cell (or a heading's words): escaped, at most `limit` characters."""
    return md_text(text if text else "(empty)", limit)


def _header(card: dict[str, Any]) -> list[str]:
    suite = card["suite"]
    return [f"# Scorecard: {_cell(suite['name'])} v{_cell(suite['version'])}", "",
            f"**{'PASSED' if card['passed'] else 'FAILED'}**: "
            f"{sum(g['passed'] for g in card['gates'])} of {len(card['gates'])} gates passed "
            f"({_cell(card['created'])}; suite sha256 {_cell(suite['sha256'][:12])}).", ""]


def _gates_and_models(card: dict[str, Any]) -> list[str]:
    lines = []
    if card["gates"]:
        lines += ["## Gates", "", "| gate | model | result | detail |", "|---|---|---|---|"]
        lines += [f"| {_cell(g['name'])} | {_cell(g['model'] or 'every candidate')} | "
                  f"{'pass' if g['passed'] else '**FAIL**'} | {_cell(g['message'])} |" for g in card["gates"]]
        lines.append("")
    compared = [_cell(m["label"]) for m in card["models"] if m.get("role") == "compare"]
    if compared:  # eval's --compare arms: beside the others on every table, never gated
        lines += [f"Compared, not gated: {', '.join(compared)} (the gates decide the candidate against the base).",
                  ""]
    lines += ["## Models", "", "| label | kind | source | weights sha256 |", "|---|---|---|---|"]
    for m in card["models"]:
        merged = " (merged)" if m["merged"] else " (unmerged)" if m["merged"] is False else ""
        weights = str(m["fingerprint"].get("weights_sha256") or "")[:12]
        ident = _cell(weights) if weights else f"served {_cell(m['fingerprint'].get('model'))}"
        lines.append(f"| {_cell(m['label'])} | {_cell(m['kind'])}{merged} | {_cell(m['source'])} | {ident} |")
    d = card["decoding"]
    settings = ", ".join(f"{key} {md_text(d[key])}" for key in ("max_new_tokens", "temperature", "top_k", "top_p",
                                                                "seed", "max_tool_rounds", "batch_size"))
    lines += ["", f"Decoding: {settings}; one chat template "
              f"(sha256 {_cell(str(card['prompt']['chat_template_sha256'])[:12])}) for all.", ""]
    return lines


def _metrics(card: dict[str, Any], labels: list[str], candidates: list[str]) -> list[str]:
    head = " | ".join([_cell(label) for label in labels] + [f"Δ {_cell(c)}" for c in candidates])
    lines = ["## Metrics", "", f"| metric | category | n | {head} |", "|---|---|---|" + "---|" * (2 * len(labels) - 1)]
    for metric in card["metrics"]:
        for category, entry in metric["by_category"].items():
            why = metric.get("not_available", {})  # "not available from this engine: ..." -> its first clause
            cells = [_v(entry["values"].get(label), metric["unit"]) if label not in why
                     else f"n/a ({_cell(str(why[label]).split(':')[0])})" for label in labels]
            cells += [_d(entry["delta"].get(c), metric["unit"]) for c in candidates]
            lines.append(f"| {_cell(metric['id'])} | {_cell(category)} | {entry['n']} | " + " | ".join(cells) + " |")
    if card["fields"]:
        lines += ["", "## Per-field accuracy", "", f"| set | field | n | {' | '.join(_cell(lab) for lab in labels)} |",
                  "|---|---|---|" + "---|" * len(labels)]
        lines += [f"| {_cell(f['set'])} | {_cell(f['field'])} | {f['n']} | " +
                  " | ".join(_v(f["values"].get(label), "ratio") for label in labels) + " |" for f in card["fields"]]
    return lines


def _domain_and_general(card: dict[str, Any], labels: list[str], candidates: list[str]) -> list[str]:
    """Continued pretraining's two figures side by side: the domain gain (held-out domain loss and
    perplexity) and its general cost (the general text's loss), each model's value and the deltas."""
    metrics = {m["id"]: m for m in card["metrics"]}
    shown = [i for i in ("domain_text/loss/perplexity", "domain_text/loss/loss", "general_text/loss/loss")
             if i in metrics]
    if not any(i.startswith("domain_text/") for i in shown):
        return []
    head = " | ".join([_cell(label) for label in labels] + [f"Δ {_cell(c)}" for c in candidates])
    lines = ["", "## Domain text against general text", "", f"| metric | tokens | {head} |",
             "|---|---|" + "---|" * (2 * len(labels) - 1)]
    for metric_id in shown:
        metric, entry = metrics[metric_id], metrics[metric_id]["by_category"]["all"]
        cells = [_v(entry["values"].get(label), metric["unit"]) for label in labels]
        cells += [_d(entry["delta"].get(c), metric["unit"]) for c in candidates]
        lines.append(f"| {_cell(metric_id)} | {entry['n']} | " + " | ".join(cells) + " |")
    return lines


def _operations(card: dict[str, Any], labels: list[str]) -> list[str]:
    lines = ["", "## Operations", "", "| model | device | parameters | active parameters | requests | p50 s | p95 s "
             "| generated tok/s | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        o = card["operations"][label]
        # Serving cost: parameters and active (per-token) parameters of a model run here; an endpoint's are unknown.
        params = " | ".join(f"{o[key]:,}" if o.get(key) is not None else "—"
                            for key in ("parameters", "active_parameters"))
        lines.append(f"| {_cell(label)} | {_cell(o['device'])} | {params} | {o['requests']} | {_v(o['p50_s'])} | "
                     f"{_v(o['p95_s'])} | {_v(o['generated_tokens_per_s'])} | {_v(o['peak_memory_gib'])} |")
    for label in labels:
        o = card["operations"][label]
        if o.get("endpoint"):
            e = o["endpoint"]
            faults = ", ".join(f"{_cell(kind)} x{n}" for kind, n in e["faults"].items()) or "none"
            lines.append(f"\n{_cell(label)} at {_cell(o['device'])} ({_cell(e['api'])}, model {_cell(e['model'])}): "
                         f"{e['http_requests']} HTTP requests, {e['retries']} retries, {e['failed_requests']} failed "
                         f"requests; faults: {faults}; prompt log-probabilities: {_cell(e['prompt_logprobs'])}; "
                         f"peak memory: {_cell(o['peak_memory_note'])}.")
    return lines


def _failures(card: dict[str, Any], candidate: str, max_failures: int) -> list[str]:
    failed = [e for e in card["examples"] if not e["outputs"][candidate]["passed"]]
    lines = ["", f"## Failures of {_cell(candidate)} ({len(failed)} of {len(card['examples'])} examples)"]
    by_set: dict[str, list] = {}
    for example in failed:
        by_set.setdefault(example["set"], []).append(example)
    for set_name, examples in by_set.items():
        lines += ["", f"### {_cell(set_name)} ({len(examples)} failed; {min(len(examples), max_failures)} shown)", "",
                  f"| id | category | prompt | reference | base | {_cell(candidate)} | why |",
                  "|---|---|---|---|---|---|---|"]
        for e in examples[:max_failures]:
            out = e["outputs"][candidate]
            lines.append(f"| {_cell(e['id'])} | {_cell(e['category'])} | {_cell(e['prompt'], 80)} | "
                         f"{_cell(e['reference'], 80)} | {_cell(e['outputs']['base']['text'], 80)} | "
                         f"{_cell(out['text'], 80)} | {_cell('; '.join(map(str, out['failures'])), 120)} |")
    return lines


def render_markdown(card: dict[str, Any], max_failures: int = 10, failures_of: list[str] | None = None) -> str:
    """The Markdown; `failures_of`: the labels whose failures are listed (default: the candidates;
    `glmtune decide` lists every arm's, the base's too)."""
    labels = [m["label"] for m in card["models"]]
    candidates = labels[1:]
    lines = _header(card) + _gates_and_models(card) + _metrics(card, labels, candidates)
    lines += _domain_and_general(card, labels, candidates) + _operations(card, labels)
    for candidate in candidates if failures_of is None else failures_of:
        lines += _failures(card, candidate, max_failures)
    return "\n".join(lines) + "\n"
