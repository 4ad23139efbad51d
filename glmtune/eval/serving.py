"""Serving metrics: what a server of the model relies on beyond its answers, teacher-forced.

  * `operations/serving/mtp_acceptance`: the share of positions t (those with a supervised
    token at t+2 in t's document) where the multi-token-prediction (MTP) layer's greedy draft
    of token t+2 equals the model's own greedy token at t+1: the share of drafts MTP
    speculative decoding accepts (greedy, one draft token), so the speed-up it buys a server.
  * `operations/serving/indexer_recall`: the share of the full attention's probability mass
    that the sparse-attention (DSA) indexer's top-k keys hold, on sampled queries with more
    allowed keys than the top-k: what sparse attention keeps of dense attention at long
    context (1.0 where the selection misses nothing).

The family's `Compute.serving_metrics` computes both over one packed batch as (sum, count).
Here every row of the suite's chat sets is rendered as the reference loss renders it (prompt +
reference turns, labels on the assistant turns after the last user turn:
`reference_loss.reference_labels`), made a one-document batch as training's collate makes one,
and the sums and counts are added over rows; a metric's value is sum / count. Sharded, every
rank runs every row in step (a forward is collective), as for the reference loss.

A value is never a silent zero: it is null with the reason when the model's spec gives no such
entry (`missing`: a checkpoint without an MTP layer), when nothing was counted (`unmeasured`:
rows shorter than the indexer's top-k), or when the backend cannot compute it (an endpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glmtune.eval.scorers.base import EvalRow, MetricDef
from glmtune.eval.scorers.reference_loss import reference_batch, reference_labels
from glmtune.eval.teacher_forced import on_model_device


@dataclass(frozen=True)
class ServingMetric:
    definition: MetricDef  # its id is operations/serving/<name>; <name> is the spec's key
    missing: str  # why a model whose spec gives no such entry has no value
    unmeasured: str  # why a count of 0 gives no value ({longest}: the longest row's tokens)


SERVING_METRICS: list[ServingMetric] = [
    ServingMetric(
        MetricDef("mtp_acceptance", "share of MTP speculative-decoding drafts accepted: the MTP layer's greedy token "
                  "for t+2 equals the model's own greedy token at t+1 (teacher-forced on the reference answers)",
                  "ratio", True),
        missing="not available from this checkpoint: it has no MTP layer (config.json num_nextn_predict_layers: 0)",
        unmeasured="not measurable on these rows: no position has a supervised token two ahead in its document"),
    ServingMetric(
        MetricDef("indexer_recall", "share of the full attention's probability mass on the keys the sparse-attention "
                  "indexer's top-k selects (sampled queries with more allowed keys than the top-k)", "ratio", True),
        missing="not available from this checkpoint: it has no sparse-attention indexer",
        unmeasured="not measurable on these rows: no query has more allowed keys than the indexer's top-k, so every "
                   "key is selected (the longest row has {longest} tokens; longer rows measure it)"),
]


@torch.no_grad()
def row_serving_sums(model, serving_metrics: Callable, row: EvalRow, prompting) -> dict[str, tuple[float, float]]:
    """name -> (sum, count) of the row under `model` (`serving_metrics`: the family's spec method)."""
    batch = on_model_device(model, reference_batch(row, prompting))
    return {name: (float(pair[0]), float(pair[1])) for name, pair in serving_metrics(model, batch).items()}


def serving_entry(totals: dict[str, list[float]], rows: list[EvalRow], failed: list[str], prompting
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """(the operations entry's `serving`, metric id -> why null) from the sums over `rows` (`failed`:
    the rows that raised, each as "file:line: error")."""
    entry = {"rows": len(rows) - len(failed), "rows_failed": len(failed), "first_error": failed[0] if failed else None,
             "totals": {name: {"sum": s, "count": c} for name, (s, c) in totals.items()}}
    not_available = {}
    for metric in SERVING_METRICS:
        name = metric.definition.name
        if not rows:
            why = "not measurable: the suite has no chat rows (measured on the chat sets' reference answers)"
        elif name not in totals:
            why = metric.missing
        elif totals[name][1] == 0:
            why = metric.unmeasured.format(longest=max(len(reference_labels(r, prompting)[0]) for r in rows))
        else:
            continue
        not_available[f"operations/serving/{name}"] = why
    return entry, not_available


def _total(ops: dict, name: str) -> dict | None:
    return ((ops.get("serving") or {}).get("totals") or {}).get(name)


def serving_value(ops: dict, name: str) -> float | None:
    """sum / count of one serving metric from an operations entry; None where not measured."""
    total = _total(ops, name)
    return total["sum"] / total["count"] if total and total["count"] > 0 else None


def serving_count(ops: dict, name: str) -> int:
    """The positions (queries) one serving metric counted for a model; 0 where not measured."""
    total = _total(ops, name)
    return int(total["count"]) if total else 0
