"""decide's alternatives, `--compare TARGET[,key=value...]` (repeatable), and the base's endpoint key.

The target and its keys are `glmtune eval`'s (`glmtune.eval.targets`: name=, model=, api=,
key-env=), and one more:

  cost-per-1k=USD    the cost of 1,000 requests, as the user knows it; shown beside the verdict

The arms decide adds itself (base, prompted, retrieval) are reserved labels.
"""

from __future__ import annotations

from glmtune.eval.targets import COST_KEY, KEYS, Target, check_key_env
from glmtune.eval.targets import check_labels as _check_labels
from glmtune.eval.targets import parse_target as _parse_target

__all__ = ["RESERVED", "Target", "check_key_env", "check_labels", "parse_target"]

RESERVED = ("base", "prompted", "retrieval")


def parse_target(spec: str) -> Target:
    """One `--compare` value: eval's keys and cost-per-1k (module docstring)."""
    return _parse_target(spec, KEYS + (COST_KEY,))


def check_labels(targets: list[Target]) -> None:
    """Each alternative's label is its own and none of decide's own arms'."""
    _check_labels(targets, RESERVED)
