"""The arms: one suite answered by the base as it is, by the base prompted with examples, by the
base with retrieved passages, and by each alternative.

Every arm answers the same rows with the same chat template and decoding (eval's `Prompting`);
the prompted and retrieval arms differ from the base only in the prompt's messages (`examples.py`,
`passages.py`): each of their rows is the base's row with another `prompt` (the last user turn,
the reference and the scorers' fields unchanged, so every arm is scored against the same answers
and the report's prompt column is the same).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from glmtune.decide.examples import ExamplePool, with_examples
from glmtune.decide.passages import CITE_INSTRUCTION, Passages, Shown, with_passages
from glmtune.eval.sets import LoadedSet


@dataclass
class ArmSpec:
    label: str
    kind: str  # base | prompted | retrieval | alternative
    model: Any  # eval's ModelSource or EndpointSource, labelled with the arm
    sets: list[LoadedSet]
    how: str  # what the arm is, for the report
    endpoint: Any = None  # eval's EndpointOptions of an endpoint model
    cost_per_1k: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # the arm's settings (examples, documents), for the report
    # (set name, row index) -> what the arm added to that prompt (examples' origins, passages shown)
    added: dict[tuple[str, int], Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "how": self.how, "source": str(self.model.source),
                "cost_per_1k_requests": self.cost_per_1k, **self.info}


def _with_prompts(loaded: list[LoadedSet], prompt_of) -> list[LoadedSet]:
    """Each set with each row's prompt replaced by `prompt_of(set name, row index, row)`."""
    return [dataclasses.replace(s, rows=[dataclasses.replace(row, prompt=prompt_of(s.spec.name, i, row))
                                         for i, row in enumerate(s.rows)]) for s in loaded]


def prompted_arm(base: ArmSpec, pool: ExamplePool, shots: int) -> ArmSpec:
    arm = ArmSpec("prompted", "prompted", dataclasses.replace(base.model, label="prompted", role="candidate"), [],
                  pool.describe(shots), base.endpoint,
                  info={"examples": {"source": pool.source, "rows": len(pool.examples), "shots": shots,
                                     "chosen": pool.how}})

    def prompt_of(set_name: str, i: int, row) -> list[dict[str, Any]]:
        chosen = pool.choose(row.last_user_text, shots)
        arm.added[(set_name, i)] = [e.origin for e in chosen]
        return with_examples(row.prompt, chosen)

    arm.sets = _with_prompts(base.sets, prompt_of)
    return arm


def retrieval_arm(base: ArmSpec, passages: Passages) -> ArmSpec:
    arm = ArmSpec("retrieval", "retrieval", dataclasses.replace(base.model, label="retrieval", role="candidate"), [],
                  passages.describe(), base.endpoint,
                  info={"documents": passages.corpus.describe(), "passages_per_prompt": passages.k,
                        "retriever": passages.retriever, "instruction": CITE_INSTRUCTION})

    def prompt_of(set_name: str, i: int, row) -> list[dict[str, Any]]:
        shown: list[Shown] = passages.for_question(row.last_user_text)
        arm.added[(set_name, i)] = shown
        return with_passages(row.prompt, shown)

    arm.sets = _with_prompts(base.sets, prompt_of)
    return arm
