"""task_success: the answer is the reference JSON object, exactly and field by field.

Both the answer and the reference are parsed as JSON (the reference must be a JSON object:
checked when the suite loads). `exact` is 1 when the parsed values are equal (key order and
whitespace do not matter); each field in `fields` (default: the reference object's keys) is
correct when the answer is an object holding an equal value under that key. `field_accuracy` is
the share of correct fields per row; the scorecard's `fields` list has each field's accuracy.
An answer that is not JSON gets every field wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmtune.eval.scorers.base import EvalRow, MetricDef, ModelOutput, RowScore, parse_json, short


class TaskSuccess:
    name = "task_success"
    row_kind = "chat"  # the rows it scores: chat rows, answered by generation

    @dataclass
    class Options:
        fields: list[str] = field(default_factory=list)  # JSON keys scored one by one; [] = the reference's keys

    def __init__(self, options: "TaskSuccess.Options", suite_dir) -> None:
        self.options = options

    @staticmethod
    def metrics(options: "TaskSuccess.Options") -> list[MetricDef]:
        return [MetricDef("exact", "answer equals the reference JSON object", "ratio", True),
                MetricDef("field_accuracy", "share of the scored fields equal to the reference's", "ratio", True)]

    def fields_of(self, row: EvalRow) -> list[str]:
        return self.options.fields or list(parse_json(row.reference or "")[0] or {})

    def check_row(self, row: EvalRow) -> list[str]:
        if row.reference is None:
            return ["task_success needs a reference answer (the last assistant turn has no content)"]
        value, error = parse_json(row.reference)
        if error or not isinstance(value, dict):
            return [f"task_success needs a JSON object as the reference answer ({error or type(value).__name__})"]
        return []

    def score(self, row: EvalRow, output: ModelOutput) -> RowScore:
        reference, _ = parse_json(row.reference)
        answer, error = parse_json(output.text)
        names = self.fields_of(row)
        correct = {name: isinstance(answer, dict) and name in answer and name in reference
                   and answer[name] == reference[name] for name in names}
        failures = []
        if error:
            failures.append(error)
        elif not isinstance(answer, dict):
            failures.append(f"answer is a JSON {type(answer).__name__}, not an object")
        else:
            for name in names:
                if correct[name]:
                    continue
                want = short(reference[name]) if name in reference else "(absent)"
                failures.append(f"{name}: missing, want {want}" if name not in answer
                                else f"{name}: got {short(answer[name])}, want {want}")
            if answer != reference and not failures:
                failures.append("fields match but the object differs (extra or other keys)")
        exact = answer == reference and not error
        accuracy = sum(correct.values()) / len(names) if names else None
        return RowScore({"exact": float(exact), "field_accuracy": accuracy}, failures, correct)
