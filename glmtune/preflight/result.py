"""One check's outcome: its number and name, pass / fail / skip, a one-line message and its evidence.

`evidence` holds what the verdict rests on (figures, paths, hashes, messages), JSON-safe,
so the report can show it and a reader can check the verdict. A skipped check says why
(`skip_reason`): which earlier check it depends on, or what this machine lacks. Only
`pass` counts as passing; `glmtune preflight` exits 0 only when all ten pass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# The ten checks, in the guide's order ("Run a proof of compatibility").
CHECKS = {
    1: ("pins", "versions, revisions and hashes pinned"),
    2: ("shards", "every shard present and intact; disk space"),
    3: ("model", "config and tokenizer without weights; chat template"),
    4: ("trainable", "trainable parameters and LoRA targets"),
    5: ("step", "one forward, backward and optimizer step on the data"),
    6: ("gradients", "finite, non-zero gradients per path"),
    7: ("resume", "save, kill, resume in a fresh process"),
    8: ("export", "export and reload with transformers"),
    9: ("generation", "base and trained outputs, same decoding"),
    10: ("multiprocess", "multi-process run of the scaled layout"),
}
STATUSES = ("pass", "fail", "skip")


@dataclass
class CheckResult:
    number: int
    status: str  # pass | fail | skip
    message: str  # one line: the verdict's evidence in short, or what failed
    evidence: dict[str, Any] = field(default_factory=dict)
    skip_reason: str | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        assert self.number in CHECKS and self.status in STATUSES, (self.number, self.status)

    @property
    def name(self) -> str:
        return CHECKS[self.number][0]

    @property
    def title(self) -> str:
        return CHECKS[self.number][1]

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "name": self.name, "title": self.title, **asdict(self),
                "evidence": json_safe(self.evidence)}


def verdict(number: int, problems: list[str], message: str, evidence: dict[str, Any]) -> CheckResult:
    """Fail with the first problem (all of them in the evidence), else pass with `message`."""
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(number, "fail", problems[0] + more, {**evidence, "problems": problems})
    return CheckResult(number, "pass", message, evidence)


def skipped(number: int, reason: str) -> CheckResult:
    return CheckResult(number, "skip", f"skipped: {reason}", skip_reason=reason)


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats as strings ("nan", "inf") and tuples and paths as JSON types."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
