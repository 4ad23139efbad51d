"""Secrets/PII lint: every detector fires, findings are located and redacted."""

from __future__ import annotations

import pytest
from data_test_helpers import chat

from glmtune.data.pii import KINDS, build_report, lint_rows, scan_row, scan_text
from glmtune.data.sources import Origin, Row, read_rows
from glmtune.data.synthetic import generate_rows

SAMPLES = {
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA",
    "aws_access_key": "AKIAIOSFODNN7EXAMPLE",
    "github_token": "ghp_" + "A1b2C3d4E5" * 4,
    "slack_token": "xoxb-1234567890-0987654321-abcdefABCDEF",
    "api_key": "sk-proj-" + "Zx9" * 10,
    "bearer_token": "Bearer eyJhbGciOiJIUzI1NiJ9.payload",
    "secret_assignment": "access_token=8f14e45fceea167a",
    "email": "jane.doe@example.co.uk",
    "phone": "(415) 555-0132",
}


def test_samples_cover_every_kind():
    assert set(SAMPLES) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_found_in_running_text(kind):
    text = f"please use {SAMPLES[kind]} for this."
    assert [found for found, _ in scan_text(text)] == [kind]


@pytest.mark.parametrize("text", ["+44 20 7946 0958", "555-123-4567", "+1 415 555 0100", "mail bob@corp.io now"])
def test_more_contact_formats(text):
    assert scan_text(text)


@pytest.mark.parametrize("text", ["order ORD-48213 on 2024-03-12", "version 1.2.3 costs 1234.56", "sk-short",
                                  "id 123-45-678", "the bearer of bad news", "a@b"])
def test_ordinary_text_is_clean(text):
    assert scan_text(text) == ()


def test_overlapping_detectors_report_once():
    assert [kind for kind, _ in scan_text("Authorization: Bearer " + SAMPLES["api_key"])] == ["api_key"]


def test_findings_carry_location_and_are_redacted(write_jsonl):
    secret = SAMPLES["aws_access_key"]
    row = chat(("user", "hi"), ("assistant", f"key {secret}"), group="jane.doe@example.com")
    path = write_jsonl("d.jsonl", [chat(("user", "hi"), ("assistant", "ok")), row])
    per_row = lint_rows(read_rows(path))
    assert per_row[0] == []
    assert sorted(str(f) for f in per_row[1]) == [
        f"{path}:2: group: email (jane...(20 chars))",
        f"{path}:2: messages[1].content: aws_access_key (AKIA...(20 chars))",
    ]
    report = build_report(per_row, "report")
    assert report["num_rows_scanned"] == 2 and report["num_rows_with_findings"] == 1
    assert report["by_kind"] == {"aws_access_key": 1, "email": 1}
    assert {"file": str(path), "line": 2, "field": "messages[1].content", "kind": "aws_access_key",
            "match": "AKIA...(20 chars)"} in report["findings"]
    assert secret not in str(report)


def test_tool_calls_and_tools_are_scanned():
    row = Row({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"token": SAMPLES["github_token"]}}}]}]},
        Origin("x.jsonl", 9))
    (finding,) = scan_row(row)
    assert finding.field == "messages[0].tool_calls[0].function.arguments.token"
    assert finding.kind == "github_token"


def test_synthetic_data_is_clean():
    rows = [Row(data, Origin("synth", i)) for i, data in enumerate(generate_rows(500, seed=3))]
    assert not any(lint_rows(rows))
