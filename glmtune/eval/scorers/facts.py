"""facts: required facts from the supplied source are in the answer; unsupported claims are not.

Each row of a facts set carries
  * `required_facts`: a list; each entry is a string, or a list of alternative strings (any one
    counts: ["7:40", "seven forty"]);
  * `forbidden_claims` (optional): strings that would be unsupported by the source (a wrong
    time, an invented name).
Matching is substring matching on the answer after collapsing whitespace, case-insensitive
unless `case_sensitive: true`. Metrics: `required_recall` (share of a row's required facts
present, averaged over rows with required facts), `supported` (rows with every required fact and
no forbidden claim) and `unsupported_claims` (forbidden claims found, a count).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, answer_text, short


def normalize(text: str, case_sensitive: bool) -> str:
    """The text facts are matched in: whitespace collapsed to single spaces, case folded unless
    `case_sensitive` (a fact matches when its `normalize` is a substring of the answer's); also
    `glmtune decide`'s grounding check, which matches the same facts against the passages shown."""
    text = re.sub(r"\s+", " ", text).strip()
    return text if case_sensitive else text.casefold()


class Facts:
    name = "facts"
    row_kind = "chat"  # the rows it scores: chat rows, answered by generation

    @dataclass
    class Options:
        case_sensitive: bool = False

    def __init__(self, options: "Facts.Options", suite_dir: Path) -> None:
        self.options = options

    @staticmethod
    def metrics(options: "Facts.Options") -> list[MetricDef]:
        return [MetricDef("required_recall", "share of the required facts present in the answer", "ratio", True),
                MetricDef("supported", "answers with every required fact and no forbidden claim", "ratio", True),
                MetricDef("unsupported_claims", "forbidden (unsupported) claims found in answers", "count", False,
                          "sum")]

    def check_row(self, row: EvalRow) -> list[str]:
        required, forbidden = row.data.get("required_facts"), row.data.get("forbidden_claims", [])
        problems = []
        if required is None and not forbidden:
            problems.append("a facts row needs required_facts or forbidden_claims")
        if required is not None and not (isinstance(required, list) and all(
                isinstance(f, str) and f or isinstance(f, list) and f and all(isinstance(a, str) and a for a in f)
                for f in required)):
            problems.append("required_facts must be a list of non-empty strings or lists of alternative strings")
        if not (isinstance(forbidden, list) and all(isinstance(c, str) and c for c in forbidden)):
            problems.append("forbidden_claims must be a list of non-empty strings")
        return problems

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        sensitive = self.options.case_sensitive
        answer = normalize(answer_text(output.text), sensitive)
        required = [[f] if isinstance(f, str) else f for f in row.data.get("required_facts") or []]
        missing = [alts for alts in required if not any(normalize(a, sensitive) in answer for a in alts)]
        claims = [c for c in row.data.get("forbidden_claims") or [] if normalize(c, sensitive) in answer]
        failures = [f"missing fact: {short(' | '.join(alts))}" for alts in missing]
        failures += [f"unsupported claim: {short(claim)}" for claim in claims]
        recall = (len(required) - len(missing)) / len(required) if required else None
        return RowScore({"required_recall": recall, "supported": float(not failures),
                         "unsupported_claims": float(len(claims))}, failures)
