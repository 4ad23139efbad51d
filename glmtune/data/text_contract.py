"""The data contract for raw text documents (`data.kind: text`): what a document must be to train on.

Each document, tokenized, goes through these rules in this order; the first that removes it is
the one the report counts (documents and tokens, EOS not counted):

  1. `too_short` / `too_long`: fewer than `min_tokens` or more than `max_tokens` tokens;
  2. `pii`: a secret or personal-data finding (pii.py's detectors over the text), with the run's
     policy: `report` keeps the document and lists it, `drop` removes it, `fail` stops the run
     after the report is written;
  3. `exact_duplicate`: the same text as an earlier document (sha256 of the text);
  4. `near_duplicate`: the same text after dedup.py's normalization (lowercase, no punctuation,
     collapsed whitespace) as an earlier document.
The first occurrence is kept, so the result depends only on the input order. Dedup runs before
the split, so a duplicate can never sit in both train and test.

Then the split (split.py's hash of the source with the run's seed): every document of one source
(a file, or the value of `data.source_field`) lands in one split, so the same document family
never straddles train and validation/test.

Memory: two sets of 32-byte digests and the set of sources, whatever the corpus' size (the PII
scan keeps no document: `_scan_uncached`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from glmtune.data.dedup import normalize_text
from glmtune.data.pii import KINDS, Finding, redact, scan_text
from glmtune.data.split import SPLITS, assign_split
from glmtune.data.text_sources import TextDocument

RULES: tuple[str, ...] = ("too_short", "too_long", "pii", "exact_duplicate", "near_duplicate")
# pii.scan_text without its cache: that cache (for chat rows' repeated system prompts) would keep up to
# 65,536 documents alive, unbounded memory on a corpus of long documents, which rarely repeat anyway.
_scan_uncached = scan_text.__wrapped__


@dataclass
class TextContract:
    """Applies the rules (module docstring) one document at a time and counts what each did."""

    min_tokens: int = 1
    max_tokens: int | None = None
    pii_action: str = "report"
    ratios: tuple[float, float, float] = (0.98, 0.02, 0.0)
    seed: int = 0
    removed: dict[str, Counter] = field(default_factory=lambda: {rule: Counter() for rule in RULES})
    kept: dict[str, Counter] = field(default_factory=lambda: {name: Counter() for name in SPLITS})
    findings: list[Finding] = field(default_factory=list)
    documents_with_findings: int = 0
    _exact: set[bytes] = field(default_factory=set)
    _near: set[bytes] = field(default_factory=set)
    _sources: dict[str, set[str]] = field(default_factory=lambda: {name: set() for name in SPLITS})

    def admit(self, document: TextDocument, num_tokens: int) -> str | None:
        """The split `document` (of `num_tokens` tokens) goes to, or None when a rule removed it."""
        rule = self._rule(document, num_tokens)
        if rule is not None:
            self.removed[rule].update(documents=1, tokens=num_tokens)
            return None
        split = assign_split(f"source:{document.source}", self.ratios, self.seed)
        self.kept[split].update(documents=1, tokens=num_tokens)
        self._sources[split].add(document.source)
        return split

    def _rule(self, document: TextDocument, num_tokens: int) -> str | None:
        if num_tokens < self.min_tokens:
            return "too_short"
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            return "too_long"
        hits = _scan_uncached(document.text)
        if hits:
            self.documents_with_findings += 1
            self.findings += [Finding(document.origin, "text", kind, redact(matched)) for kind, matched in hits]
            if self.pii_action == "drop":
                return "pii"
        exact = hashlib.sha256(document.text.encode()).digest()
        if exact in self._exact:
            return "exact_duplicate"
        self._exact.add(exact)
        near = hashlib.sha256(normalize_text(document.text).encode()).digest()
        if near in self._near:
            return "near_duplicate"
        self._near.add(near)
        return None

    def pii_report(self) -> dict[str, Any]:
        """pii.py's report shape (pii_report.json), over documents."""
        by_kind = Counter(finding.kind for finding in self.findings)
        scanned = sum(counts["documents"] for counts in self.kept.values()) + sum(
            self.removed[rule]["documents"] for rule in ("pii", "exact_duplicate", "near_duplicate"))
        return {"action": self.pii_action, "num_rows_scanned": scanned,
                "num_rows_with_findings": self.documents_with_findings, "num_findings": len(self.findings),
                "by_kind": {kind: by_kind[kind] for kind in KINDS if by_kind[kind]},
                "findings": [finding.to_dict() for finding in self.findings]}

    def report(self) -> dict[str, Any]:
        """What came in, what each rule removed and what each split kept (documents, tokens, sources)."""
        input_counts = Counter()
        for counts in [*self.removed.values(), *self.kept.values()]:
            input_counts.update(counts)
        return {
            "input": {"documents": input_counts["documents"], "tokens": input_counts["tokens"]},
            "removed": {rule: {"documents": self.removed[rule]["documents"], "tokens": self.removed[rule]["tokens"]}
                        for rule in RULES},
            "splits": {name: {"documents": self.kept[name]["documents"], "tokens": self.kept[name]["tokens"],
                              "sources": len(self._sources[name])} for name in SPLITS},
            "pii": {"action": self.pii_action, "documents_with_findings": self.documents_with_findings,
                    "findings": len(self.findings)},
        }


def removal_notes(report: dict[str, Any]) -> list[str]:
    """One line per rule that removed something (and per PII finding kept), for the console."""
    total = report["input"]["documents"]
    notes = [f"removed {counts['documents']:,} of {total:,} documents ({counts['tokens']:,} tokens): {rule}"
             for rule, counts in report["removed"].items() if counts["documents"]]
    pii = report["pii"]
    if pii["documents_with_findings"] and pii["action"] == "report":
        notes.append(f"kept {pii['documents_with_findings']:,} documents with secret/PII findings (data.pii: report; "
                     f"{pii['findings']:,} findings in pii_report.json)")
    return notes
