"""Bundled synthetic preference task: the support-ticket rows as (chosen, rejected) pairs.

Each row of synthetic.py becomes one preference row:
  * prompt: the row's messages before its final answer; for a tool-calling row that
    includes the assistant's `lookup_order` call and the tool response, so the
    preference is on the final answer only;
  * chosen: the reference JSON answer;
  * rejected: a plausible wrong answer, the corruption cycling with the row index
    through `REJECTED_KINDS`:
      - wrong_severity:    another valid severity;
      - wrong_next_action: the next action of another category;
      - invalid_json:      the reference answer truncated (closing brace lost) or
                           written with single quotes, alternately.
`group`, `category` and `tools` are kept, `rejected_kind` names the corruption (for
per-kind scorecards), `id` is `pref-<seed>-<index>`. Everything follows from the
seed: the tickets through synthetic.generate_rows, the wrong values through a private
`random.Random` of the seed. chosen satisfies synthetic.SCHEMA_PATH; rejected is
meant not to be right, and two of its kinds still satisfy the schema on purpose.
"""

from __future__ import annotations

import json
import random
from typing import Any

from glmtune.data.synthetic import NEXT_ACTIONS, SEVERITIES, generate_rows

REJECTED_KINDS: tuple[str, ...] = ("wrong_severity", "wrong_next_action", "invalid_json")


def _rejected_answer(answer: str, kind: str, index: int, rng: random.Random) -> str:
    """A wrong answer of `kind` for the reference JSON `answer`."""
    reference = json.loads(answer)
    if kind == "wrong_severity":
        wrong = dict(reference, severity=rng.choice([s for s in SEVERITIES if s != reference["severity"]]))
        return json.dumps(wrong)
    if kind == "wrong_next_action":
        actions = [action for action in NEXT_ACTIONS if action != reference["next_action"]]
        return json.dumps(dict(reference, next_action=rng.choice(actions)))
    assert kind == "invalid_json", kind
    # Alternate between the two ways a model's JSON most often breaks.
    return answer[:-1] if (index // len(REJECTED_KINDS)) % 2 == 0 else answer.replace('"', "'")


def preference_row(row: dict[str, Any], index: int, *, seed: int, rng: random.Random) -> dict[str, Any]:
    """The preference row made from one synthetic SFT row (module docstring)."""
    *prompt, answer = row["messages"]
    kind = REJECTED_KINDS[index % len(REJECTED_KINDS)]
    out: dict[str, Any] = {"id": f"pref-{seed}-{index:06d}", "group": row["group"], "category": row["category"],
                           "rejected_kind": kind, "prompt": prompt, "chosen": [answer],
                           "rejected": [{"role": "assistant",
                                         "content": _rejected_answer(answer["content"], kind, index, rng)}]}
    if row.get("tools"):
        out["tools"] = row["tools"]
    return out


def generate_preference_rows(num_rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """`num_rows` deterministic preference rows for `seed`.

    Args:
        num_rows: rows to generate (one per synthetic ticket).
        seed: seeds the tickets (synthetic.generate_rows) and the wrong answers.
    """
    rng = random.Random(f"support_preferences:{seed}")  # str seeds hash deterministically (sha512)
    return [preference_row(row, i, seed=seed, rng=rng) for i, row in enumerate(generate_rows(num_rows, seed=seed))]
