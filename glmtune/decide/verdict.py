"""The verdict: the seed guide's decision before training, by written rules over the gates.

Every gate of the suite is checked in every arm (`glmtune.eval.gates`; a relative rule compares
the arm with the base arm, so the base's own `improves` gate never passes and its
`no_regression` always does). An arm *passes* when it passes every gate. The rules, in order, the
first that holds decides (docs/decide.md):

  1. stop         the base passes                             "stop: the base passes every gate"
  2. prompting    the prompted arm passes                     "prompting is enough"
  3. retrieval    the retrieval arm passes                    "use retrieval"
  4. alternative  one or more alternatives pass               "an alternative passes: NAME (cost per 1k requests)",
                                                              the cheapest first (a cost not given last)
  5. fine-tune    some gates fail in every arm                "fine-tune: these gates fail in every arm: ...",
                                                              each with its category and the guide's job for it
  6. combine      no arm passes, yet every gate passes in some arm: the arms that pass each gate
                  are named (prompting with retrieval, retrieval on an alternative) to try together

The order is the cheapest change first: nothing; a prompt; an index; another model; training.
Exit status (as `glmtune eval`'s 0 / 1): 0 for rules 1-4 (no training needed), 1 for 5 and 6.

A gate's category is its metric's scorer's (`CATEGORIES`), and the job is the guide's table's:
format, task and tool arguments -> supervised fine-tuning (SFT); refusals and preferences ->
preference optimization; facts -> continued pretraining when retrieval did not fix them (the
facts are stable) or better retrieval (they change); general capability and operations are not
fixed by fine-tuning this model (a regression budget; distillation into a smaller model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT_NO_TRAINING, EXIT_FINE_TUNE = 0, 1

ARM_KINDS = ("base", "prompted", "retrieval", "alternative")

# scorer (the metric id's middle part; general_text and operations by their set) -> (category, job)
_SFT = "supervised fine-tuning (SFT)"
CATEGORIES: dict[str, tuple[str, str]] = {
    "task_success": ("task", _SFT),
    "format": ("format", _SFT),
    "reference_loss": ("task", _SFT),
    "tool_execution": ("tool arguments", _SFT + ", then task-level evaluation"),
    "facts": ("facts", "continued pretraining on the documents if the facts are stable; better retrieval if they "
                       "change"),
    "refusal": ("refusals", "preference optimization"),
    "preference": ("preferences", "preference optimization"),
    "general_text": ("general capability", "none by fine-tuning: it is a regression budget (keep the base)"),
    "operations": ("operations", "none by fine-tuning this model: distillation into a smaller model, or serving "
                                 "changes"),
}
_OTHER = ("other", _SFT)


@dataclass(frozen=True)
class Arm:
    label: str
    kind: str  # one of ARM_KINDS
    cost_per_1k: float | None = None  # an alternative's cost per 1,000 requests, as given


@dataclass
class Verdict:
    kind: str  # stop | prompting | retrieval | alternative | fine-tune | combine
    text: str  # the verdict in the guide's terms, with its figures
    rule: str  # the rule that decided
    exit_code: int
    passing: list[str] = field(default_factory=list)  # arms that pass every gate
    failing_everywhere: list[dict] = field(default_factory=list)  # {gate, metric, category, job, messages}
    passes_in: dict[str, list[str]] = field(default_factory=dict)  # gate -> arms that pass it

    def to_json(self) -> dict:
        return {"kind": self.kind, "text": self.text, "rule": self.rule, "exit_code": self.exit_code,
                "passing": self.passing, "failing_everywhere": self.failing_everywhere, "passes_in": self.passes_in}


def category_of(metric: str) -> tuple[str, str]:
    """(category, the guide's job for it) of a metric id `set/scorer/name`."""
    first, scorer = metric.split("/")[:2]
    if first in ("general_text", "operations"):
        return CATEGORIES[first]
    return CATEGORIES.get(scorer, _OTHER)


def _gate_table(arms: list[Arm], gates: list[dict]) -> dict[str, dict]:
    """gate name -> {metric, by arm label: (passed, message)}; every arm must have a record of every gate."""
    table: dict[str, dict] = {}
    for g in gates:
        entry = table.setdefault(g["name"], {"metric": g["metric"], "arms": {}})
        entry["arms"][g["model"]] = (g["passed"], g["message"])
    for name, entry in table.items():
        missing = [a.label for a in arms if a.label not in entry["arms"]]
        assert not missing, f"gate {name} has no result for {missing}"
    return table


def _alternatives(passing: list[Arm]) -> str:
    ranked = sorted(passing, key=lambda a: (a.cost_per_1k is None, a.cost_per_1k or 0.0))
    named = [f"{a.label} (" + (f"cost per 1k requests {a.cost_per_1k:g}" if a.cost_per_1k is not None
                               else "no cost given") + ")" for a in ranked]
    first = "an alternative passes: " if len(named) == 1 else "alternatives pass, the cheapest first: "
    return first + ", ".join(named)


def decide(arms: list[Arm], gates: list[dict], not_tried: dict[str, str] | None = None) -> Verdict:
    """The verdict (module docstring) from the scorecard's gate records of every arm (each gate
    evaluated with `model` = the arm's label). `not_tried`: arm kind -> why it did not run."""
    assert arms and arms[0].kind == "base" and all(a.kind in ARM_KINDS for a in arms), arms
    assert gates, "decide needs gates"
    table = _gate_table(arms, gates)
    passes_in = {name: [a.label for a in arms if e["arms"][a.label][0]] for name, e in table.items()}
    passing = [a for a in arms if all(a.label in labels for labels in passes_in.values())]
    n = len(table)
    by_kind = {kind: [a for a in passing if a.kind == kind] for kind in ARM_KINDS}
    passing_labels = [a.label for a in passing]
    if by_kind["base"]:
        return Verdict("stop", f"stop: the base passes every gate ({n} of {n})", "1: the base passes every gate",
                       EXIT_NO_TRAINING, passing_labels, [], passes_in)
    if by_kind["prompted"]:
        return Verdict("prompting", f"prompting is enough: the prompted arm passes every gate ({n} of {n})",
                       "2: the prompted arm passes every gate", EXIT_NO_TRAINING, passing_labels, [], passes_in)
    if by_kind["retrieval"]:
        return Verdict("retrieval", f"use retrieval: the retrieval arm passes every gate ({n} of {n})",
                       "3: the retrieval arm passes every gate", EXIT_NO_TRAINING, passing_labels, [], passes_in)
    if by_kind["alternative"]:
        return Verdict("alternative", _alternatives(by_kind["alternative"]), "4: an alternative passes every gate",
                       EXIT_NO_TRAINING, passing_labels, [], passes_in)
    return _training(arms, table, passes_in, not_tried or {})


def _training(arms: list[Arm], table: dict[str, dict], passes_in: dict[str, list[str]],
              not_tried: dict[str, str]) -> Verdict:
    tried = ", ".join(a.label for a in arms)
    untried = "".join(f"; not tried: {kind} ({why})" for kind, why in not_tried.items())
    everywhere = []
    for name, entry in table.items():
        if passes_in[name]:
            continue
        category, job = category_of(entry["metric"])
        everywhere.append({"gate": name, "metric": entry["metric"], "category": category, "job": job,
                           "messages": {label: message for label, (_, message) in entry["arms"].items()}})
    if everywhere:
        listed = "; ".join(f"{g['gate']} ({g['category']}: {g['job']})" for g in everywhere)
        return Verdict("fine-tune", f"fine-tune: these gates fail in every arm ({tried}): {listed}{untried}",
                       "5: some gates fail in every arm", EXIT_FINE_TUNE, [], everywhere, passes_in)
    where = "; ".join(f"{name} passes only in {', '.join(labels)}" for name, labels in passes_in.items()
                      if len(labels) < len(arms))
    return Verdict("combine", f"combine before training: no arm passes every gate, but each gate passes in some arm "
                              f"({where}): try those arms together (prompting with retrieval, retrieval on an "
                              f"alternative){untried}",
                   "6: no arm passes every gate, and none fails in every arm", EXIT_FINE_TUNE, [], [], passes_in)
