"""preference: on held-out pairs, how often a model ranks the chosen answer above the rejected one.

A preference set's rows are preference rows (TRL's conversational format: prompt, chosen,
rejected; `glmtune.data.preferences`), scored teacher-forced: nothing is generated. Each answer
is rendered after the prompt with the suite's chat template exactly as DPO training renders it
(`tokenize_pair`: labels on the answer's tokens only, its turn end included), and its sequence
log-probability is the sum over those tokens. Per model and pair:

    margin              = log π(chosen) − log π(rejected)
    prefers chosen      = margin > 0

and for a candidate, against the base (the model it started from, DPO's reference), with
β = `beta` (default 0.1, DPO's usual value and the tiny DPO recipe's `dpo.beta`):

    implicit margin     = β [(log π_c(chosen) − log π_b(chosen)) − (log π_c(rejected) − log π_b(rejected))]
    implicit-reward acc = implicit margin > 0

the quantity DPO's loss pushes up (−log σ(implicit margin)); it is > 0 where the fine-tune moved
probability toward the chosen answer relative to the base, whatever the base preferred.

Metrics: `preference_accuracy` and `mean_margin` (nats) for every model; `implicit_reward_accuracy`
and `mean_implicit_margin` for candidates only (the base's own would be 0 by definition: null).
The evaluation computes the log-probabilities (`pair_logps` on a local model, the engine's prompt
log-probabilities on an endpoint) and leaves them on the output; the implicit values are added
once the base's are known (`with_base`). A row fails when the model prefers the rejected answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmtune.data.chat_template import TokenizedSample
from glmtune.data.packing import pack_pairs
from glmtune.data.preferences import tokenize_pair
from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore
from glmtune.eval.teacher_forced import micro_batch
from glmtune.train.data_loader import collate
from glmtune.train.preference_loss import pair_logps

MAX_BETA = 1e3


@dataclass
class PairLogps:
    """One model's sequence log-probabilities of one pair (sums over each answer's tokens)."""

    chosen: float
    rejected: float
    chosen_tokens: int
    rejected_tokens: int
    implicit_margin: float | None = None  # β × the log-ratio margin against the base (candidates)

    @property
    def margin(self) -> float:
        return self.chosen - self.rejected

    def to_json(self) -> dict[str, Any]:
        return {"logp_chosen": self.chosen, "logp_rejected": self.rejected, "margin": self.margin,
                "chosen_tokens": self.chosen_tokens, "rejected_tokens": self.rejected_tokens,
                "implicit_margin": self.implicit_margin}


class Preference:
    name = "preference"
    row_kind = "preference"  # the rows it scores (sets.py refuses the other kind)

    @dataclass
    class Options:
        beta: float = 0.1  # scales the implicit reward margin, as DPO's beta

    def __init__(self, options: "Preference.Options", suite_dir: Path) -> None:
        if not 0 < options.beta <= MAX_BETA:
            raise ValueError(f"beta: must be > 0 and <= {MAX_BETA:g}, got {options.beta!r}")
        self.options = options

    @staticmethod
    def metrics(options: "Preference.Options") -> list[MetricDef]:
        return [
            MetricDef("preference_accuracy", "share of pairs where log p(chosen) > log p(rejected)", "ratio", True),
            MetricDef("mean_margin", "mean of log p(chosen) - log p(rejected), nats", "nats", True),
            MetricDef("implicit_reward_accuracy", "share of pairs where the implicit reward margin against the "
                      "base is > 0 (candidates only)", "ratio", True, candidate_only=True),
            MetricDef("mean_implicit_margin", f"mean of beta ({options.beta:g}) x [(log pc(chosen) - log pb(chosen)) "
                      "- (log pc(rejected) - log pb(rejected))] (candidates only)", "nats", True,
                      candidate_only=True),
        ]

    def check_row(self, row: EvalRow) -> list[str]:
        return []

    def with_base(self, output: ModelOutput, base: ModelOutput) -> None:
        """Set the candidate output's implicit margin from the base's log-probabilities of the pair."""
        c, b = output.preference, base.preference
        if c is not None and b is not None:
            c.implicit_margin = self.options.beta * ((c.chosen - b.chosen) - (c.rejected - b.rejected))

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        empty = dict.fromkeys(m.name for m in self.metrics(self.options))
        if output.preference_not_available is not None:  # the backend cannot compute it: no value, no failure
            return RowScore(empty)
        pair = output.preference
        if pair is None:  # the log-probabilities raised on this row
            assert output.preference_error is not None, "the pair's log-probabilities are computed before scoring"
            return RowScore(empty, [f"preference not computed: {output.preference_error}"])
        implicit = pair.implicit_margin
        values = {"preference_accuracy": float(pair.margin > 0), "mean_margin": pair.margin,
                  "implicit_reward_accuracy": None if implicit is None else float(implicit > 0),
                  "mean_implicit_margin": implicit}
        failures = [] if pair.margin > 0 else [f"prefers rejected: log p(chosen) {pair.chosen:.3f} <= "
                                               f"log p(rejected) {pair.rejected:.3f}"]
        return RowScore(values, failures)


def summary_text(pair: PairLogps) -> str:
    """The example's "answer" in the reports: what the model made of the pair."""
    verdict = "prefers chosen" if pair.margin > 0 else "prefers rejected"
    implicit = f"; implicit margin {pair.implicit_margin:+.4f}" if pair.implicit_margin is not None else ""
    return (f"{verdict}: log p(chosen) {pair.chosen:.3f}, log p(rejected) {pair.rejected:.3f}, "
            f"margin {pair.margin:+.3f}{implicit}")


def pair_samples(row: EvalRow, prompting) -> tuple[TokenizedSample, TokenizedSample]:
    """(chosen, rejected) of the row tokenized as DPO training tokenizes them (the suite's system
    prompt applied to the prompt)."""
    data = dict(row.data, prompt=row.prompt)
    return tokenize_pair(data, prompting.tokenizer, template=prompting.template,
                         enable_thinking=prompting.enable_thinking, name=row.origin)


@torch.no_grad()
def local_pair_logps(model, token_logps, row: EvalRow, prompting) -> PairLogps:
    """The pair's log-probabilities under an in-process model: the pair packed into one row as
    training packs it (documents 0 and 1), `token_logps` (the family's `spec.compute.token_logps`) and
    the per-document sums of `glmtune.train.preference_loss.pair_logps`."""
    chosen, rejected = pair_samples(row, prompting)
    size = len(chosen.input_ids) + len(rejected.input_ids)
    rows, _ = pack_pairs([(chosen, rejected)], size, pad_token_id=0)  # exactly the pair: no padding
    assert len(rows) == 1, f"{row.origin}: the pair has no answer token to score"
    mb = micro_batch(model, collate(rows))
    sums = pair_logps(token_logps(model, mb).float(), mb.targets, mb.document_ids, [2])
    return PairLogps(float(sums["chosen"][0]), float(sums["rejected"][0]), int(sums["chosen_tokens"][0]),
                     int(sums["rejected_tokens"][0]))
