"""The decision directory: decision.json, decision.md, decision.html, suite.yaml and sets/.

decision.json (format `glmtune.decision/1`) holds the verdict (its rule, the gates failing in
every arm with their category and job, where each gate passes), the arms (what each is: the
examples' choice, the retrieval's chunking and k, each alternative's source and cost), the cost of
the training alternative (`--recipe`: the plan's figures), and eval's scorecard with the arms as
its models (`glmtune.scorecard/1`: per-category scores, every gate checked in every arm, every
example's answers; each example also records what an arm added to its prompt: the examples'
origins, the passages shown with their scores, the grounding failures).

decision.md and decision.html are the scorecard's own Markdown and HTML page (`glmtune.eval.
report_md`, `report_html`) with the decision first: the verdict, its rule, the cost line, the
arms, each gate in each arm, and the retrieval arm's failures beside the passages it was shown.
Every string is escaped as the scorecard's are.

No API key reaches a file: every string of the decision is checked for the keys the endpoints
were given (their values, from the environment) and each occurrence replaced (a server may echo
a key in an error message), and the written files are checked again before they appear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.decide.cost import cost_line
from glmtune.eval.report_html import render_html
from glmtune.eval.report_md import render_markdown
from glmtune.eval.targets import REDACTED, redact  # noqa: F401 - REDACTED: decide's API
from glmtune.io import json_out
from glmtune.io.escape import md_text
from glmtune.io.outputs import output_dir

FORMAT = "glmtune.decision/1"
MAX_PASSAGE_ROWS = 10  # the retrieval arm's failures shown with their passages in the reports


def _added(arm, key: tuple[str, int]) -> Any:
    value = arm.added.get(key)
    if value is None:
        return None
    return [shown.to_json() for shown in value] if arm.kind == "retrieval" else value


def decision_document(card: dict, arms: list, verdict, not_tried: dict[str, str], cost: dict | None,
                      grounding_failures: dict) -> dict[str, Any]:
    """The decision (module docstring); the scorecard's examples gain `added` and `grounding`."""
    index: dict[str, int] = {}
    for example in card["examples"]:
        i = index[example["set"]] = index.get(example["set"], -1) + 1
        added = {arm.label: _added(arm, (example["set"], i)) for arm in arms if arm.added}
        example["added"] = {label: value for label, value in added.items() if value is not None}
        if (example["set"], i) in grounding_failures:
            example["grounding_failures"] = grounding_failures[(example["set"], i)]
    return {
        "format": FORMAT,
        "created": card["created"],
        "verdict": {**verdict.to_json(), "cost": cost_line(cost) if cost else []},
        "arms": [arm.describe() for arm in arms],
        "not_tried": not_tried,
        "cost": cost,
        "scorecard": card,
    }


def _gate_rows(card: dict, labels: list[str]) -> list[list[str]]:
    by_gate: dict[str, dict[str, bool]] = {}
    for g in card["gates"]:
        by_gate.setdefault(g["name"], {})[g["model"]] = g["passed"]
    return [[name] + ["pass" if passed[label] else "FAIL" for label in labels] for name, passed in by_gate.items()]


def _passage_rows(decision: dict, label: str) -> list[list[str]]:
    rows = []
    for e in decision["scorecard"]["examples"]:
        out = e["outputs"][label]
        if out["passed"] and not e.get("grounding_failures"):
            continue
        shown = e.get("added", {}).get(label) or []
        passages = " · ".join(f"[{s['number']}] {s['where']} ({s['score']:.2f}): {s['text'][:120]}" for s in shown)
        why = "; ".join(list(out["failures"]) + list(e.get("grounding_failures", [])))
        rows.append([e["set"], e["id"], e["prompt"][:120], passages or "(no passage shares a word with it)",
                     out["text"][:120], why[:200]])
        if len(rows) == MAX_PASSAGE_ROWS:
            break
    return rows


def preface(decision: dict) -> dict[str, Any]:
    """The decision section both reports show first: {title, paragraphs, tables}."""
    card, verdict = decision["scorecard"], decision["verdict"]
    labels = [a["label"] for a in decision["arms"]]
    passed = {label: sum(g["passed"] for g in card["gates"] if g["model"] == label) for label in labels}
    total = len({g["name"] for g in card["gates"]})
    paragraphs = [f"Rule {verdict['rule']} (exit status {verdict['exit_code']}: "
                  f"{'no training needed' if verdict['exit_code'] == 0 else 'training is the next step'})."]
    paragraphs += verdict["cost"] or ["The training alternative is not priced (no --recipe)."]
    paragraphs += [f"Not tried: {kind} ({why})." for kind, why in decision["not_tried"].items()]
    tables = [{"caption": "Arms", "columns": ["arm", "kind", "what", "gates passed", "cost per 1k requests"],
               "rows": [[a["label"], a["kind"], a["how"], f"{passed[a['label']]} of {total}",
                         "—" if a["cost_per_1k_requests"] is None else format(a["cost_per_1k_requests"], "g")]
                        for a in decision["arms"]]},
              {"caption": "Each gate in each arm", "columns": ["gate"] + labels, "rows": _gate_rows(card, labels)}]
    if verdict["failing_everywhere"]:
        tables.append({"caption": "Gates failing in every arm, and the guide's job for them",
                       "columns": ["gate", "metric", "category", "job"],
                       "rows": [[g["gate"], g["metric"], g["category"], g["job"]]
                                for g in verdict["failing_everywhere"]]})
    retrieval = next((a["label"] for a in decision["arms"] if a["kind"] == "retrieval"), None)
    if retrieval is not None:
        tables.append({"caption": f"The retrieval arm's failures and the passages it was shown (the first "
                                  f"{MAX_PASSAGE_ROWS})", "columns": ["set", "id", "prompt", "passages shown",
                                                                      "answer", "why"],
                       "rows": _passage_rows(decision, retrieval)})
    return {"title": f"Decision: {verdict['text']}", "paragraphs": paragraphs, "tables": tables}


def render_preface_markdown(section: dict[str, Any]) -> str:
    lines = [f"# {md_text(section['title'])}", ""] + [md_text(p) + "\n" for p in section["paragraphs"]]
    for table in section["tables"]:
        lines += [f"## {md_text(table['caption'])}", "", "| " + " | ".join(md_text(c) for c in table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(md_text(cell, 300) for cell in row) + " |" for row in table["rows"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def write_decision(out: Path, overwrite: bool, reads: list, suite, loaded, decision: dict,
                   secrets: list[str]) -> dict:
    """Write the directory (module docstring); returns the decision as written (keys redacted)."""
    decision = redact(decision, secrets)
    section = preface(decision)
    labels = [a["label"] for a in decision["arms"]]
    files = {"decision.json": json_out.dumps(decision, indent=1, ensure_ascii=False) + "\n",
             "decision.md": render_preface_markdown(section) + render_markdown(decision["scorecard"],
                                                                               failures_of=labels),
             "decision.html": render_html(decision["scorecard"], section)}
    with output_dir(out, overwrite=overwrite, sources=reads, what="--out", command="decide") as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8", errors="backslashreplace")
        (tmp / "suite.yaml").write_bytes(suite.data)
        (tmp / "sets").mkdir()
        for s in loaded:
            (tmp / "sets" / f"{s.spec.name}.jsonl").write_bytes(s.jsonl)
        for path in tmp.rglob("*"):  # the sets and the suite are the user's files: a key there is theirs
            assert not (path.is_file() and path.parent == tmp and path.suffix != ".yaml"
                        and any(secret.encode() in path.read_bytes() for secret in secrets)), path
    return decision
