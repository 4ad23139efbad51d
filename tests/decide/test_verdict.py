"""The verdict rules (glmtune/decide/verdict.py, docs/decide.md) as a table: each row is a
scorecard's gate results per arm and the verdict, its rule and exit status the rules give."""

from __future__ import annotations

import pytest

from glmtune.decide.verdict import Arm, category_of, decide

BASE, PROMPTED, RETRIEVAL = Arm("base", "base"), Arm("prompted", "prompted"), Arm("retrieval", "retrieval")
API = Arm("api", "alternative", 0.8)
SMALL = Arm("small", "alternative", 0.2)
NOCOST = Arm("trained", "alternative")

GATES = {"exact": "tickets/task_success/exact", "format": "tickets/format/critical_failures",
         "tools": "tickets/tool_execution/success", "facts": "catalog/facts/supported",
         "refusal": "refusal/refusal/accuracy", "latency": "operations/latency/p95_s",
         "prose": "general_text/loss/loss"}


def _card(arms: list[Arm], fails: dict[str, set[str]]) -> list[dict]:
    """The gate records of a scorecard: gate name -> the arm labels where it fails."""
    return [{"name": gate, "metric": GATES[gate], "model": arm.label, "passed": arm.label not in fails.get(gate, ()),
             "message": f"{arm.label} value"} for gate in ("exact", "format", "facts", "refusal", "latency", "tools",
                                                           "prose") if gate in fails for arm in arms]


ALL = {"base", "prompted", "retrieval", "api", "small", "trained"}
TABLE = [
    # (arms, gate -> arms failing it, verdict kind, exit status, the verdict text starts with)
    ([BASE, PROMPTED, RETRIEVAL], {"exact": set(), "format": set()}, "stop", 0,
     "stop: the base passes every gate (2 of 2)"),
    ([BASE, PROMPTED, RETRIEVAL], {"exact": {"base"}, "format": set()}, "prompting", 0,
     "prompting is enough: the prompted arm passes every gate (2 of 2)"),
    ([BASE, PROMPTED, RETRIEVAL], {"exact": {"base"}, "facts": {"base", "prompted"}}, "retrieval", 0,
     "use retrieval: the retrieval arm passes every gate (2 of 2)"),
    # prompting and retrieval both pass: the cheaper change (a prompt) is the verdict
    ([BASE, PROMPTED, RETRIEVAL], {"exact": {"base"}}, "prompting", 0, "prompting is enough"),
    ([BASE, PROMPTED, RETRIEVAL, API], {"exact": {"base", "prompted", "retrieval"}, "format": set()}, "alternative", 0,
     "an alternative passes: api (cost per 1k requests 0.8)"),
    ([BASE, API, NOCOST, SMALL], {"exact": {"base"}}, "alternative", 0,
     "alternatives pass, the cheapest first: small (cost per 1k requests 0.2), api (cost per 1k requests 0.8), "
     "trained (no cost given)"),
    ([BASE, PROMPTED, RETRIEVAL, API], {"exact": ALL - {"prompted"}, "format": ALL, "refusal": ALL, "latency": {"api"}},
     "fine-tune", 1, "fine-tune: these gates fail in every arm (base, prompted, retrieval, api): format (format: "
     "supervised fine-tuning (SFT)); refusal (refusals: preference optimization)"),
    ([BASE, RETRIEVAL], {"facts": ALL, "tools": ALL - {"retrieval"}}, "fine-tune", 1,
     "fine-tune: these gates fail in every arm (base, retrieval): facts (facts: continued pretraining on the "
     "documents if the facts are stable; better retrieval if they change); not tried: prompted (no --examples)"),
    ([BASE, PROMPTED, RETRIEVAL], {"exact": ALL - {"prompted"}, "facts": ALL - {"retrieval"}}, "combine", 1,
     "combine before training: no arm passes every gate, but each gate passes in some arm (exact passes only in "
     "prompted; facts passes only in retrieval)"),
    ([BASE], {"prose": ALL, "latency": set()}, "fine-tune", 1,
     "fine-tune: these gates fail in every arm (base): prose (general capability: none by fine-tuning"),
]


@pytest.mark.parametrize("arms, fails, kind, code, text", TABLE)
def test_verdict_table(arms, fails, kind, code, text):
    not_tried = {"prompted": "no --examples"} if PROMPTED not in arms and RETRIEVAL in arms else None
    verdict = decide(arms, _card(arms, fails), not_tried)
    assert (verdict.kind, verdict.exit_code) == (kind, code)
    assert verdict.text.startswith(text), verdict.text
    assert verdict.passing == [a.label for a in arms if not any(a.label in f for f in fails.values())]
    everywhere = [g["gate"] for g in verdict.failing_everywhere]
    assert everywhere == ([g for g, f in fails.items() if {a.label for a in arms} <= f] if kind == "fine-tune" else [])


def test_the_verdict_names_each_failing_arms_message_and_where_each_gate_passes():
    arms = [BASE, PROMPTED]
    verdict = decide(arms, _card(arms, {"format": ALL, "exact": {"base"}}))
    assert verdict.failing_everywhere == [{"gate": "format", "metric": GATES["format"], "category": "format",
                                           "job": "supervised fine-tuning (SFT)",
                                           "messages": {"base": "base value", "prompted": "prompted value"}}]
    assert verdict.passes_in == {"exact": ["prompted"], "format": []}
    assert verdict.rule == "5: some gates fail in every arm"


@pytest.mark.parametrize("metric, category", [("tickets/task_success/field_accuracy", "task"),
                                              ("x/tool_execution/success", "tool arguments"),
                                              ("pairs/preference/preference_accuracy", "preferences"),
                                              ("operations/serving/mtp_acceptance", "operations"),
                                              ("general_text/loss/loss", "general capability")])
def test_categories(metric, category):
    assert category_of(metric)[0] == category
