"""scorecard.md: the scorecard as Markdown for a terminal, a pull request or a release note.

Sections: the verdict and the gates, the models, every metric by category (each model's value,
the delta from the base, n), per-field accuracy, operations, and the failures of each candidate
listed beside the reference and the base's answer (the first `max_failures` per set).
"""

from __future__ import annotations

from typing import Any


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


def _cell(text: str | None, limit: int = 160) -> str:
    text = "(empty)" if not text else text
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


def render_markdown(card: dict[str, Any], max_failures: int = 10) -> str:
    labels = [m["label"] for m in card["models"]]
    candidates = labels[1:]
    suite = card["suite"]
    lines = [f"# Scorecard: {suite['name']} v{suite['version']}", "",
             f"**{'PASSED' if card['passed'] else 'FAILED'}**: "
             f"{sum(g['passed'] for g in card['gates'])} of {len(card['gates'])} gates passed "
             f"({card['created']}; suite sha256 {suite['sha256'][:12]}).", ""]
    if card["gates"]:
        lines += ["## Gates", "", "| gate | model | result | detail |", "|---|---|---|---|"]
        lines += [f"| {_cell(g['name'])} | {g['model']} | {'pass' if g['passed'] else '**FAIL**'} | {_cell(g['message'])} |"
                  for g in card["gates"]]
        lines.append("")
    lines += ["## Models", "", "| label | kind | source | weights sha256 |", "|---|---|---|---|"]
    for m in card["models"]:
        merged = " (merged)" if m["merged"] else " (unmerged)" if m["merged"] is False else ""
        ident = m["fingerprint"].get("weights_sha256", "")[:12] or f"served `{m['fingerprint'].get('model')}`"
        lines.append(f"| {m['label']} | {m['kind']}{merged} | `{m['source']}` | {ident} |")
    d = card["decoding"]
    lines += ["", f"Decoding: max_new_tokens {d['max_new_tokens']}, temperature {d['temperature']}, top_k {d['top_k']}, "
              f"top_p {d['top_p']}, seed {d['seed']}, max_tool_rounds {d['max_tool_rounds']}, batch_size "
              f"{d['batch_size']}; one chat template (sha256 {card['prompt']['chat_template_sha256'][:12]}) for all.", ""]
    head = " | ".join(labels + [f"Δ {c}" for c in candidates])
    lines += ["## Metrics", "", f"| metric | category | n | {head} |", "|---|---|---|" + "---|" * (2 * len(labels) - 1)]
    for metric in card["metrics"]:
        for category, entry in metric["by_category"].items():
            why = metric.get("not_available", {})  # "not available from this engine: ..." -> its first clause
            cells = [_v(entry["values"].get(label), metric["unit"]) if label not in why
                     else f"n/a ({why[label].split(':')[0]})" for label in labels]
            cells += [_d(entry["delta"].get(c), metric["unit"]) for c in candidates]
            lines.append(f"| {metric['id']} | {category} | {entry['n']} | " + " | ".join(cells) + " |")
    if card["fields"]:
        lines += ["", "## Per-field accuracy", "", f"| set | field | n | {' | '.join(labels)} |",
                  "|---|---|---|" + "---|" * len(labels)]
        lines += [f"| {f['set']} | {f['field']} | {f['n']} | " + " | ".join(_v(f["values"].get(label), "ratio")
                                                                       for label in labels) + " |"
                  for f in card["fields"]]
    lines += ["", "## Operations", "", "| model | device | requests | p50 s | p95 s | generated tok/s | peak GiB |",
              "|---|---|---|---|---|---|---|"]
    for label in labels:
        o = card["operations"][label]
        lines.append(f"| {label} | {o['device']} | {o['requests']} | {_v(o['p50_s'])} | {_v(o['p95_s'])} | "
                     f"{_v(o['generated_tokens_per_s'])} | {_v(o['peak_memory_gib'])} |")
    for label in labels:
        o = card["operations"][label]
        if o.get("endpoint"):
            e = o["endpoint"]
            faults = ", ".join(f"{kind} x{n}" for kind, n in e["faults"].items()) or "none"
            lines.append(f"\n{label} at `{o['device']}` ({e['api']}, model `{e['model']}`): {e['http_requests']} HTTP "
                         f"requests, {e['retries']} retries, {e['failed_requests']} failed requests; faults: {faults}; "
                         f"prompt log-probabilities: {e['prompt_logprobs']}; peak memory: {o['peak_memory_note']}.")
    for candidate in candidates:
        failed = [e for e in card["examples"] if not e["outputs"][candidate]["passed"]]
        lines += ["", f"## Failures of {candidate} ({len(failed)} of {len(card['examples'])} examples)"]
        by_set: dict[str, list] = {}
        for example in failed:
            by_set.setdefault(example["set"], []).append(example)
        for set_name, examples in by_set.items():
            lines += ["", f"### {set_name} ({len(examples)} failed; {min(len(examples), max_failures)} shown)", "",
                      f"| id | category | prompt | reference | base | {candidate} | why |", "|---|---|---|---|---|---|---|"]
            for e in examples[:max_failures]:
                out = e["outputs"][candidate]
                lines.append(f"| {e['id']} | {e['category']} | {_cell(e['prompt'], 80)} | {_cell(e['reference'], 80)} | "
                             f"{_cell(e['outputs']['base']['text'], 80)} | {_cell(out['text'], 80)} | "
                             f"{_cell('; '.join(out['failures']), 120)} |")
    return "\n".join(lines) + "\n"
