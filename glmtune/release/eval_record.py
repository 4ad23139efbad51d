"""The evaluation a release rests on: an eval directory written by `glmtune eval` (docs/eval.md).

    EVAL_DIR/scorecard.json   the scores, gates and the models that were compared
    EVAL_DIR/suite.yaml       a byte copy of the suite file that ran
    EVAL_DIR/sets/NAME.jsonl  the exact rows each set evaluated

`load_eval` reads the scorecard and checks that the files beside it are the ones it names
(suite.yaml and every set by sha256): a release must not cite scores for rows that were
edited afterwards. `eval_section` is what the manifest keeps of it: the suite's name,
version and hash, each set's hash, the scores of category "all" per model label with the
deltas, the operations summary, the gates and whether they passed.

`released_candidate` finds the candidate that is the run being released: the scorecard's
candidate whose fingerprint equals the hashes of the run's own artifacts as they are now
(full fine-tune: RUN_DIR/hf's config and weight identity; LoRA: the sha256 of
adapter_config.json and adapter_model.safetensors of either layout), preferring an unmerged
one (a LoRA release ships the adapter; a merged candidate's scores are recorded beside it).
A candidate whose source is the run but whose fingerprint differs is the run as it was
when evaluated, not as it is now: refused, like any other mismatch; so is a candidate served by
an endpoint (its fingerprint is the URL, the served model id and the engine, no hashes). An
endpoint base is recorded as the scorecard names it (`models`: endpoint, model, engine_server,
engine_owned_by, engine_version) with its request accounting (`operations.<label>.endpoint`). An adapter candidate's
fingerprint also names the base it ran on, which must be the release's base.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from glmtune.release.artifacts import hash_file, read_format_json

SCORECARD_FORMAT = "glmtune.scorecard/1"
_REQUIRED = ("suite", "models", "metrics", "gates", "passed")


def sha256_of(path: Path) -> str:
    return hash_file(path)[1]


def load_eval(eval_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(scorecard, its sha256), after checking the eval directory (see the module docstring)."""
    eval_dir = Path(eval_dir)
    path = eval_dir / "scorecard.json"
    if not eval_dir.is_dir():
        raise ValueError(f"--eval {eval_dir}: no such directory (run glmtune eval SUITE --base ... --candidate "
                         "RUN_DIR --out DIR first)")
    if not path.is_file():
        raise ValueError(f"--eval {eval_dir}: no scorecard.json (not a glmtune eval directory)")
    scorecard, raw = read_format_json(path, SCORECARD_FORMAT, str(path))
    for key in _REQUIRED:
        if key not in scorecard:
            raise ValueError(f"{path}: no {key!r} (an incomplete scorecard)")
    suite = scorecard["suite"]
    suite_copy = eval_dir / "suite.yaml"
    if not suite_copy.is_file():
        raise ValueError(f"--eval {eval_dir}: no suite.yaml (the copy of the suite that ran)")
    if sha256_of(suite_copy) != suite.get("sha256"):
        raise ValueError(f"{suite_copy}: sha256 differs from the suite the scorecard names "
                         f"({str(suite.get('sha256'))[:12]}…): edited after the eval")
    for entry in suite.get("sets", []):
        rows = eval_dir / "sets" / f"{entry['name']}.jsonl"
        if not rows.is_file():
            raise ValueError(f"--eval {eval_dir}: set {entry['name']!r} has no rows file {rows}")
        if sha256_of(rows) != entry.get("sha256"):
            raise ValueError(f"{rows}: sha256 differs from the set the scorecard names "
                             f"({str(entry.get('sha256'))[:12]}…): edited after the eval")
    return scorecard, hashlib.sha256(raw).hexdigest()


def failed_gates(scorecard: dict[str, Any]) -> list[str]:
    return [f"{g.get('name')} ({g.get('model')}: {g.get('message')})" for g in scorecard["gates"]
            if not g.get("passed")]


def _same_path(a: str | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def _hash_keys(fingerprint: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in fingerprint.items() if k.endswith("sha256") and isinstance(v, str)}


def released_candidate(scorecard: dict[str, Any], run_dir: Path, shipped: dict[str, dict[str, str]],
                       eval_dir: Path) -> tuple[dict[str, Any], str]:
    """(the scorecard's model entry for the run being released, the shipped artifact it matched);
    ValueError naming the mismatch.

    Args:
        shipped: artifact name -> the hashes it has now, under the scorecard's fingerprint keys
            (`glmtune eval`: an HF directory's config and weight identity; an adapter's
            adapter_config.json and adapter_model.safetensors sha256). Either adapter layout
            may have been evaluated: they hold the same adapter.
    """
    candidates = [m for m in scorecard["models"] if m.get("role") == "candidate"]
    if not candidates:
        raise ValueError(f"{eval_dir / 'scorecard.json'}: no candidate model")
    run_paths = [run_dir, *(run_dir / d for d in ("hf", "adapter", "adapter_per_expert"))]
    primary = next(iter(shipped))
    reasons = []
    for model in sorted(candidates, key=lambda m: bool(m.get("merged"))):  # unmerged first
        theirs = _hash_keys(model.get("fingerprint") or {})
        for name, ours in shipped.items():
            if theirs and theirs == {k: ours.get(k) for k in theirs}:
                if not model.get("merged"):
                    return model, name
                reasons.append(f"{model['label']!r} is the merged model")
                break
        else:
            ours = shipped[primary]
            differing = [k for k in sorted(theirs) if k in ours and theirs[k] != ours[k]]
            from_run = any(_same_path(model.get("source"), p) for p in run_paths)
            if differing:
                key = differing[0]
                reasons.append(f"{model['label']!r} ({model.get('source')}) has {key} {theirs[key][:12]}…, the run's "
                               f"{primary} {ours[key][:12]}…" + (" (the run changed after the eval)" if from_run
                                                                  else ""))
            elif model.get("kind") == "endpoint":
                reasons.append(f"{model['label']!r} is the endpoint {model.get('source')} (served model "
                               f"{(model.get('fingerprint') or {}).get('model')!r}): its weights cannot be checked "
                               "against the run's; evaluate the run's files as the candidate (an endpoint may be the "
                               "base)")
            else:
                reasons.append(f"{model['label']!r} ({model.get('source')}) has no fingerprint to compare with the "
                               f"run's {primary} ({', '.join(sorted(ours))})")
    raise ValueError(f"--eval {eval_dir} did not evaluate the run {run_dir}: " + "; ".join(reasons))


def check_evaluated_base(candidate: dict[str, Any], base: dict[str, Any], eval_dir: Path) -> None:
    """An adapter candidate's fingerprint names the base it ran on: it must be the release's base."""
    ran_on = _hash_keys((candidate.get("fingerprint") or {}).get("base") or {})
    differing = [k for k in sorted(ran_on) if base.get(k) and ran_on[k] != base[k]]
    if differing:
        key = differing[0]
        raise ValueError(f"--eval {eval_dir} ran the adapter on a base with {key} {ran_on[key][:12]}…, but the "
                         f"release's base has {base[key][:12]}…: evaluate on the base that will serve")


def _score_summary(metric: dict[str, Any]) -> dict[str, Any]:
    cell = (metric.get("by_category") or {}).get("all") or {}
    return {"id": metric["id"], "unit": metric.get("unit"), "higher_is_better": metric.get("higher_is_better"),
            "n": cell.get("n"), "values": cell.get("values") or {}, "delta": cell.get("delta") or {}}


_OPERATION_KEYS = ("requests", "p50_s", "p95_s", "generated_tokens", "generated_tokens_per_s", "peak_memory_gib",
                   "device")
_ENDPOINT_KEYS = ("peak_memory_note", "endpoint")  # an endpoint model's, recorded when present


def eval_section(scorecard: dict[str, Any], scorecard_sha256: str, candidate: dict[str, Any], evaluated: str,
                 allow_failed_gates: bool, stored_dir: str) -> dict[str, Any]:
    """What the manifest keeps of the eval (see the module docstring)."""
    suite = scorecard["suite"]
    operations = {label: {k: ops.get(k) for k in _OPERATION_KEYS}
                  | {k: ops[k] for k in _ENDPOINT_KEYS if k in ops}
                  for label, ops in (scorecard.get("operations") or {}).items()}
    return {
        "path": stored_dir,
        "scorecard_sha256": scorecard_sha256,
        "created": scorecard.get("created"),
        "glmtune": scorecard.get("glmtune"),
        "suite": {"name": suite.get("name"), "version": suite.get("version"), "sha256": suite.get("sha256"),
                  "sets": [{k: s.get(k) for k in ("name", "sha256", "rows", "scorers", "source")}
                           for s in suite.get("sets", [])]},
        "decoding": scorecard.get("decoding"),
        "models": [{k: m.get(k) for k in ("label", "role", "kind", "source", "fingerprint", "merged")}
                   for m in scorecard["models"]],
        "candidate": candidate["label"],
        "evaluated_artifact": evaluated,
        "scores": [_score_summary(m) for m in scorecard["metrics"]],
        "operations": operations,
        "gates": [{k: g.get(k) for k in ("name", "metric", "category", "model", "rule", "threshold", "value",
                                         "base_value", "passed", "message")} for g in scorecard["gates"]],
        "passed": bool(scorecard["passed"]),
        "allowed_failed_gates": bool(allow_failed_gates and not scorecard["passed"]),
    }
