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


@pytest.mark.parametrize("change, message", [
    (("name: t", "name: ../../x"), r"suite.yaml:1: name: '../../x' contains a path separator"),
    (("name: t", "name: '.'"), r"suite.yaml:1: name: '.' is empty or a relative directory"),
    (("name: t", "name: '-rf'"), r"suite.yaml:1: name: '-rf' starts with '-'"),
    (("  - name: rows", "  - name: '..'"), r"suite.yaml:9: sets\[0\].name: '..' is empty or a relative directory"),
    (("  - name: rows", "  - name: a/b"), r"suite.yaml:9: sets\[0\].name: 'a/b' contains a path separator"),
])
def test_names_that_become_file_names_are_names_not_paths(tmp_path, change, message):
    """The suite name is CAND/eval/<name> (replaced by --overwrite), a set name DIR/sets/<name>.jsonl."""
    with pytest.raises(ValueError, match=message):
        load_suite(_suite(tmp_path, VALID.replace(*change)))


@pytest.mark.parametrize("line, message", [
    ("  max_new_tokens: 1000000000000", r"suite.yaml:4: decoding.max_new_tokens: must be >= 1 and <= 32768, "
                                        r"got 1000000000000"),
    ("  temperature: .nan", r"suite.yaml:5: decoding.temperature: must be >= 0 and <= 100, got nan"),
    ("  top_p: 0", r"decoding.top_p: must be > 0 and <= 1, got 0.0"),
    ("  top_k: 10000000", r"decoding.top_k: must be >= 0 and <= 1048576"),
    ("  seed: -1", r"decoding.seed: must be >= 0 and <= 4294967295, got -1"),
    ("  max_tool_rounds: 1000", r"decoding.max_tool_rounds: must be >= 0 and <= 16"),
    ("  batch_size: 100000", r"decoding.batch_size: must be >= 1 and <= 1024"),
    ("  stop_strings: [" + ", ".join(["x"] * 33) + "]", r"decoding.stop_strings: 33 stop strings, more than 32"),
])
def test_decoding_numbers_are_finite_and_bounded(tmp_path, line, message):
    text = VALID.replace("  max_new_tokens: 8", line if "max_new_tokens" in line else f"  max_new_tokens: 8\n{line}")
    with pytest.raises(ValueError, match=message):
        load_suite(_suite(tmp_path, text))


@pytest.mark.parametrize("change, message", [
    (("tools:\n", "tools:\n  timeout_s: .inf\n"), r"suite.yaml:6: tools.timeout_s: must be > 0 and <= 3600, got inf"),
    (("tools:\n", "tools:\n  timeout_s: 1e12\n"), r"tools.timeout_s: must be > 0 and <= 3600, got 1000000000000.0"),
    (("    path: rows.jsonl", "    path: rows.jsonl\n    limit: 100000000"),
     r"suite.yaml:11: sets\[0\].limit: must be >= 1 and <= 100000, got 100000000"),
    (("  path: text.txt", "  path: text.txt\n  max_tokens: 1000000000"),
     r"suite.yaml:17: general_text.max_tokens: must be >= 2 and <= 262144"),
    (("  path: text.txt", "  path: text.txt\n  window: 1"), r"general_text.window: must be >= 2 and <= 32768, got 1"),
    (("    threshold: 0", "    threshold: .inf"),
     r"suite.yaml:20: gates\[0\].threshold: must be >= -1e\+09 and <= 1e\+09"),
    (("metric: rows/format/critical_failures\n    rule: max\n    threshold: 0",
      "metric: rows/format/valid_json\n    rule: min\n    threshold: 75"),
     r"gates\[0\].threshold: must be >= -1 and <= 1, got 75.0"),  # a ratio: 75% is 0.75
])
def test_every_other_number_is_finite_and_bounded(tmp_path, change, message):
    assert change[0] in VALID
    with pytest.raises(ValueError, match=message):
        load_suite(_suite(tmp_path, VALID.replace(*change)))


def test_a_suite_file_over_its_size_cap_is_refused_before_it_is_parsed(tmp_path):
    path = _suite(tmp_path, VALID + "#" * (1 << 20) + "\n")
    with pytest.raises(ValueError, match=r"suite.yaml: 1,04\d,\d\d\d bytes, more than the 1,048,576 a suite file may"):
        load_suite(path)
