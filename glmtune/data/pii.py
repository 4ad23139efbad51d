"""Secrets and PII lint for chat rows.

Regex detectors for credentials (API keys such as `sk-...`, AWS access key ids,
GitHub and Slack tokens, bearer tokens, `api_key=...`-style assignments, PEM
private keys) and personal data (e-mail addresses, phone numbers). Every string of
a row is scanned (messages, or a preference row's prompt, chosen and rejected; tool
calls and responses, tools, metadata), and each finding records the row's `file:line`
and the field path (`messages[1].content`, `chosen[0].content`). Matches are redacted in
findings so the report itself never leaks the secret it flags.

Detectors run most specific first, and a match overlapping an earlier one in the
same string is skipped, so `Bearer sk-...` is one `api_key` finding, not two.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from glmtune.data.contract import iter_strings
from glmtune.data.sources import Origin, Row

PII_ACTIONS = ("report", "drop", "fail")

# kind -> pattern, most specific first (see module docstring).
PATTERNS: dict[str, re.Pattern[str]] = {
    "private_key": re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"),
    "aws_access_key": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "github_token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b"),
    "slack_token": re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}|https://hooks\.slack\.com/services/[A-Za-z0-9/]+"),
    "api_key": re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}"),
    "bearer_token": re.compile(r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{16,}=*"),
    "secret_assignment": re.compile(
        r"(?i)\b(?:access[_-]?token|auth[_-]?token|api[_-]?key|secret[_-]?key|client[_-]?secret|password)"
        r"[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9\-._~+/!@#$%^&*]{8,}"),
    "email": re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
    # North-American 3-3-4 (optional +1, optional parentheses) or `+CC` international
    # numbers with separators; bare digit runs (order ids, amounts) do not match.
    "phone": re.compile(r"(?<![\w+])(?:\+?1[\s.-]?)?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?![\w-])"
                        r"|(?<![\w+])\+\d{1,3}(?:[\s.-]\d{2,4}){2,5}(?![\w-])"),
}
KINDS: tuple[str, ...] = tuple(PATTERNS)


@dataclass(frozen=True)
class Finding:
    origin: Origin
    field: str
    kind: str
    redacted: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.field}: {self.kind} ({self.redacted})"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.origin.path, "line": self.origin.line, "field": self.field,
                "kind": self.kind, "match": self.redacted}


def redact(text: str) -> str:
    """Keep just enough to recognise a match: its first 4 characters and its length."""
    return f"{text[:4]}...({len(text)} chars)"


@lru_cache(maxsize=1 << 16)  # system prompts and tool specs repeat across rows
def scan_text(text: str) -> tuple[tuple[str, str], ...]:
    """(kind, matched text) for every detector hit in `text`, without overlaps."""
    taken: list[tuple[int, int]] = []
    hits: list[tuple[int, str, str]] = []
    for kind, pattern in PATTERNS.items():
        for match in pattern.finditer(text):
            start, end = match.span()
            if any(start < t_end and t_start < end for t_start, t_end in taken):
                continue
            taken.append((start, end))
            hits.append((start, kind, match.group()))
    return tuple((kind, matched) for _, kind, matched in sorted(hits))


def scan_row(row: Row) -> list[Finding]:
    """Findings in every string of a row, with field paths like `messages[1].content`."""
    if not isinstance(row.data, dict):
        return []
    findings = []
    for key, value in row.data.items():
        for field, text in iter_strings(value, key):
            findings.extend(Finding(row.origin, field, kind, redact(matched)) for kind, matched in scan_text(text))
    return findings


def lint_rows(rows: Iterable[Row]) -> list[list[Finding]]:
    """Per-row findings, aligned with `rows` (an empty list for a clean row)."""
    return [scan_row(row) for row in rows]


def build_report(per_row: list[list[Finding]], action: str) -> dict[str, Any]:
    """JSON-ready report: totals, counts per kind, and every finding with its location."""
    findings = [finding for row_findings in per_row for finding in row_findings]
    by_kind = Counter(finding.kind for finding in findings)
    return {
        "action": action,
        "num_rows_scanned": len(per_row),
        "num_rows_with_findings": sum(1 for row_findings in per_row if row_findings),
        "num_findings": len(findings),
        "by_kind": {kind: by_kind[kind] for kind in KINDS if by_kind[kind]},
        "findings": [finding.to_dict() for finding in findings],
    }
