"""The scorers a suite's sets name (`type:`), one module each (docs/eval.md: what each measures)."""

from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, ToolCall
from glmtune.eval.scorers.facts import Facts
from glmtune.eval.scorers.format import Format
from glmtune.eval.scorers.preference import Preference
from glmtune.eval.scorers.reference_loss import ReferenceLoss
from glmtune.eval.scorers.refusal import Refusal
from glmtune.eval.scorers.task_success import TaskSuccess
from glmtune.eval.scorers.tool_execution import ToolExecution

SCORERS = {cls.name: cls for cls in (TaskSuccess, Format, ToolExecution, Facts, Refusal, ReferenceLoss, Preference)}

__all__ = ["SCORERS", "EvalRow", "MetricDef", "ModelOutput", "RowScore", "ToolCall"]
