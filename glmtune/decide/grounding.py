"""The retrieval arm's factual support checked against the passages it was shown.

For every set with the `facts` scorer, the retrieval arm's answers are checked beside that scorer
(which checks them against the row's reference facts) against the source they were given:

  * `passage_support` (ratio): of the answers that state at least one of the row's required facts,
    the share whose every stated fact is also in a passage shown (the facts scorer's matching:
    whitespace collapsed, case-insensitive unless the set's `case_sensitive`); a fact stated but in
    no passage was not taken from the documents;
  * `cited` (ratio): of the prompts shown passages, the share whose answer cites one by its number
    ([1] .. [k]);
  * `bad_citations` (count): citations of a number that was not shown.

The metrics are `SET/grounding/NAME` in the report, with a value for the retrieval arm only; the
other arms' are null with the reason ("no passages shown to this arm").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from glmtune.decide.passages import Shown
from glmtune.eval import aggregate
from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, answer_text
from glmtune.eval.scorers.facts import normalize as normalize_fact  # the facts scorer's own matching

_CITATION = re.compile(r"\[(\d{1,4})\]")
NOT_SHOWN = "not available for this arm: no passages were shown to it"


class Grounding:
    """Scores one arm's answers against the passages shown (module docstring); a scorer's shape,
    so `glmtune.eval.aggregate` makes its metrics."""

    name = "grounding"

    @dataclass
    class Options:
        case_sensitive: bool = False

    def __init__(self, case_sensitive: bool) -> None:
        self.options = Grounding.Options(case_sensitive)

    @staticmethod
    def metrics(options: "Grounding.Options") -> list[MetricDef]:
        return [MetricDef("passage_support", "answers whose stated required facts are all in a passage shown", "ratio",
                          True),
                MetricDef("cited", "answers citing a passage shown, by its number", "ratio", True),
                MetricDef("bad_citations", "citations of a passage number that was not shown", "count", False, "sum")]

    def score(self, row: EvalRow, output: ModelOutput, shown: list[Shown]) -> RowScore:
        if not shown:
            return RowScore({"passage_support": None, "cited": None, "bad_citations": None})
        sensitive = self.options.case_sensitive
        answer = answer_text(output.text)
        said = normalize_fact(answer, sensitive)
        source = normalize_fact(" ".join(s.chunk.text for s in shown), sensitive)
        required = [[f] if isinstance(f, str) else f for f in row.data.get("required_facts") or []]
        stated = [[a for a in alts if normalize_fact(a, sensitive) in said] for alts in required]
        stated = [alts for alts in stated if alts]
        unsupported = [alts[0] for alts in stated if not any(normalize_fact(a, sensitive) in source for a in alts)]
        numbers = [int(n) for n in _CITATION.findall(answer)]
        bad = [n for n in numbers if not 1 <= n <= len(shown)]
        failures = [f"stated but in no passage shown: {fact}" for fact in unsupported]
        failures += [f"cites [{n}], which was not shown" for n in bad]
        support = float(not unsupported) if stated else None
        return RowScore({"passage_support": support, "cited": float(len(numbers) > len(bad)),
                         "bad_citations": float(len(bad))}, failures)


def grounding_metrics(loaded, outputs: dict[str, dict[str, list[ModelOutput]]],
                      shown: dict[tuple[str, int], list[Shown]], labels: list[str],
                      retrieval_label: str) -> tuple[list[dict], dict[tuple[str, int], list[str]]]:
    """The scorecard metric records of every facts set (values for `retrieval_label` only), and the
    failures of each of its rows: (set name, row index) -> the phrases (a fact in no passage, a bad citation)."""
    records, failures = [], {}
    for s in loaded:
        facts = [scorer for scorer in s.spec.scorers if scorer.name == "facts"]
        if not facts:
            continue
        grounding = Grounding(facts[0].options.case_sensitive)
        name = s.spec.name
        blank = [grounding.score(row, ModelOutput("", "", [], 0.0, 0, "answer"), []) for row in s.rows]
        scores = {label: {name: {grounding.name: blank}} for label in labels}
        scores[retrieval_label][name][grounding.name] = arm = [
            grounding.score(row, out, shown.get((name, i), []))
            for i, (row, out) in enumerate(zip(s.rows, outputs[retrieval_label][name]))]
        failures.update({(name, i): score.failures for i, score in enumerate(arm) if score.failures})
        for record in aggregate.set_metrics(name, s.rows, [grounding], scores, labels):
            record["not_available"] = {label: NOT_SHOWN for label in labels if label != retrieval_label}
            records.append(record)
    return records, failures
