"""reference_loss: how likely the model finds the reference answer (teacher-forced), in nats per token.

Exact-match scores stay at 0 until a model gets answers wholly right; the reference's loss
moves from the first steps of training, and per category it shows where a fine-tune helped or
hurt (on task-free prompts: whether general answering degraded). The row is rendered whole
with the chat template (the suite's system prompt applied), with training's loss mask cut where
the last user turn opens (`glmtune.data.chat_template.tokenize_reply`; the opening is the
template's turn format's: GLM's `<|user|>`, ChatML's `<|im_start|>user`, Llama-3's user header):
the tool-call turn, if any, and the final answer, each with the token that ends it.
The row's value is the mean loss over those tokens; the metric is the mean over rows.

Unlike the other scorers it reads the model, not its generated output: the evaluation calls
`row_loss` for each row of the set per model, and `score` reads the value it left on the output
(or, when it raised on that row, the reason: the row fails, with no value). A backend that cannot
compute it (an engine without prompt log-probabilities) leaves the reason in
`reference_loss_not_available`: no value and no failure; the scorecard says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from glmtune.data.chat_template import tokenize_reply
from glmtune.data.packing import next_token_targets
from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore
from glmtune.eval.teacher_forced import one_document, summed_loss


class ReferenceLoss:
    name = "reference_loss"
    row_kind = "chat"  # the rows it scores: chat rows, answered by generation

    @dataclass
    class Options:
        pass

    def __init__(self, options: "ReferenceLoss.Options", suite_dir: Path) -> None:
        self.options = options

    @staticmethod
    def metrics(options: "ReferenceLoss.Options") -> list[MetricDef]:
        return [MetricDef("loss", "mean loss of the reference answer's tokens given the prompt (teacher-forced)",
                          "nats_per_token", False)]

    def check_row(self, row: EvalRow) -> list[str]:
        return []

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        if output.reference_loss_not_available is not None:  # the backend cannot compute it: no value, no failure
            return RowScore({"loss": None})
        if output.reference_loss is None:  # row_loss raised on this row
            assert output.reference_loss_error is not None, "row_loss runs before scoring"
            return RowScore({"loss": None}, [f"reference loss not computed: {output.reference_loss_error}"])
        return RowScore({"loss": output.reference_loss})


def reference_labels(row: EvalRow, prompting) -> tuple[list[int], list[int]]:
    """(input ids, labels) of the whole reference conversation, labels (the token itself, -100
    elsewhere) only on the assistant turns after the last user turn: a training row's shape."""
    sample = tokenize_reply(row.prompt + row.reference_turns, prompting.tokenizer, tools=row.tools,
                            template=prompting.template, enable_thinking=prompting.enable_thinking)
    return sample.input_ids, sample.labels


def reference_sample(row: EvalRow, prompting) -> tuple[list[int], list[int]]:
    """(input ids, next-token targets) of the whole reference conversation, targets only on
    the assistant turns after the last user turn."""
    ids, labels = reference_labels(row, prompting)
    return ids, next_token_targets(labels)


def reference_batch(row: EvalRow, prompting) -> dict:
    """The row's reference conversation (`reference_labels`) as a one-row, one-document packed batch."""
    return one_document(*reference_labels(row, prompting))


def row_loss(model, loss, row: EvalRow, prompting) -> float:
    """The row's mean reference loss (nats per token) under `model` (`loss`: its family's `spec.compute.loss`)."""
    total, count = summed_loss(model, loss, reference_batch(row, prompting))
    return total / max(count, 1)
