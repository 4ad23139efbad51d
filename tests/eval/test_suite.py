"""Suite files: the bundled one loads; every mistake is one error naming the file:line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmtune.data.synthetic import SCHEMA_PATH
from glmtune.eval.suite import load_suite

VALID = f"""\
name: t
version: 1
decoding:
  max_new_tokens: 8
tools:
  functions:
    lookup_order: glmtune.data.synthetic:lookup_order
sets:
  - name: rows
    path: rows.jsonl
    scorers:
      - type: format
        schema: {SCHEMA_PATH}
      - refusal
general_text:
  path: text.txt
gates:
  - metric: rows/format/critical_failures
    rule: max
    threshold: 0
"""


def _suite(tmp_path: Path, text: str) -> Path:
    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}, '
                                        '{"role": "assistant", "content": "{}"}]}\n')
    (tmp_path / "text.txt").write_text("Some plain text.\n")
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    return path


def test_bundled_and_minimal_suites_load(tmp_path):
    bundled = load_suite("tiny/eval_support_json")  # a name under recipes/, as `glmtune train` takes
    assert bundled.name == "support-json" and bundled.version == "1"
    assert [s.name for s in bundled.sets] == ["tickets", "refusal", "general"]
    assert {"tickets/task_success/exact", "tickets/format/critical_failures", "tickets/tool_execution/success",
            "refusal/refusal/accuracy", "general/facts/supported", "general_text/loss/loss",
            "operations/latency/p95_s"} <= set(bundled.metrics)
    suite = load_suite(_suite(tmp_path, VALID))
    assert suite.version == "1" and suite.sets[0].scorers[1].options.markers  # int version read as text
    assert suite.metrics["rows/format/critical_failures"].reduce == "sum"


@pytest.mark.parametrize("change, message", [
    (("  max_new_tokens: 8", "  max_new_token: 8"),
     r"suite.yaml:4: unknown key 'decoding.max_new_token' \(did you mean 'decoding.max_new_tokens'\?\)"),
    (("  max_new_tokens: 8", "  max_new_tokens: 0"), r"suite.yaml:4: decoding.max_new_tokens: must be >= 1"),
    (("version: 1\n", ""), r"suite.yaml: version: required"),
    (("    path: rows.jsonl", "    path: missing.jsonl"), r"suite.yaml:10: sets\[0\].path: file not found"),
    (("    path: rows.jsonl", "    path: rows.jsonl\n    run_split: validation"),
     r"suite.yaml:9: sets\[0\]: give exactly one of path"),
    (("      - refusal", "      - refusals"),
     r"suite.yaml:14: sets\[0\].scorers\[1\]: a scorer is a name or a mapping"),
    (("      - refusal", "      - {type: refusal, marker: [x]}"),
     r"suite.yaml:14: unknown key 'sets\[0\].scorers\[1\].marker' \(did you mean"),
    (("      - refusal", "      - {type: refusal, patterns: ['(']}"),
     r"suite.yaml:14: sets\[0\].scorers\[1\]: refusal pattern '\(' is not a valid regular expression"),
    ((f"schema: {SCHEMA_PATH}", "schema: nope.json"), r"suite.yaml:12: sets\[0\].scorers\[0\]: schema file not found"),
    (("      - refusal", "      - format"), r"scorer format appears twice in set rows"),
    (("lookup_order: glmtune.data.synthetic:lookup_order", "lookup_order: glmtune.data.synthetic"),
     r"suite.yaml:7: tools.functions.lookup_order: expected 'module:function'"),
    (("metric: rows/format/critical_failures", "metric: rows/format/critical"),
     r"suite.yaml:18: gates\[0\].metric: unknown metric 'rows/format/critical'; the suite's metrics: "),
    (("metric: rows/format/critical_failures", "metric: other/format/critical_failures"),
     r"gates\[0\].metric: unknown metric .* \(did you mean rows/format/critical_failures\?\)"),
    (("    threshold: 0\n", ""), r"suite.yaml:18: gates\[0\].threshold: rule max needs a threshold"),
    (("    rule: max", "    rule: at_most"), r"suite.yaml:19: gates\[0\].rule: expected one of 'improves'"),
    (("  path: text.txt", "  path: none.txt"), r"suite.yaml:16: general_text.path: file not found"),
    (("  - name: rows", "  - name: general_text"), r"sets\[0\].name: 'general_text' is reserved"),
])
def test_mistakes_are_named(tmp_path, change, message):
    old, new = change
    assert old in VALID
    with pytest.raises(ValueError, match=message):
        load_suite(_suite(tmp_path, VALID.replace(old, new)))


def test_several_mistakes_are_listed_together(tmp_path):
    text = VALID.replace("  max_new_tokens: 8", "  max_new_tokens: 0\n  batch_size: 0")
    with pytest.raises(ValueError, match=r"2 suite errors:\n  .*max_new_tokens.*\n  .*batch_size"):
        load_suite(_suite(tmp_path, text))
