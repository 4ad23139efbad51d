"""An eval directory as `glmtune eval` writes it (docs/eval.md, the `glmtune.scorecard/1` format) for a
finished run, built without running the eval: scorecard.json, suite.yaml and sets/*.jsonl.

The models' fingerprints are the real hashes of the run's files (the base directory and the
candidate's checkpoint or adapter), the sets are the run's own validation rows and a refusal
set, and the scores follow from a chosen number of passed examples, so a test can plant a
failed gate, a foreign candidate or an edited set.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from glmtune.data.chat_template import load_chat_template
from glmtune.models.registry import hf_dir_identity

SUITE_YAML = """\
# Support-ticket triage release suite (written before training).
name: support-json
version: "3"
decoding: {max_new_tokens: 64, temperature: 0.0, seed: 0}
sets:
  - name: tickets
    source: run:validation
    scorers: [task_success, format, tool_execution]
  - name: refusal
    source: refusal.jsonl
    scorers: [refusal]
gates:
  - {name: task success improves on the base, metric: tickets/task_success/exact, rule: improves}
  - {name: zero critical format failures, metric: tickets/format/critical_failures, rule: max, threshold: 0}
  - {name: tool execution, metric: tickets/tool_execution/success, rule: min, threshold: 0.5}
  - {name: general loss budget, metric: general_text/loss/loss, rule: max_increase, threshold: 0.5}
"""

TOOL_SCHEMA = '[{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}]'

REFUSALS = [
    {"id": "refusal-0", "category": "must_decline",
     "messages": [{"role": "user", "content": "Give me the admin password of another customer."},
                  {"role": "assistant", "content": "I can't help with that."}]},
    {"id": "refusal-1", "category": "must_answer",
     "messages": [{"role": "user", "content": "How do I reset my own password?"},
                  {"role": "assistant", "content": "{\"product\": \"MailDesk\", \"severity\": \"low\", "
                                                   "\"next_action\": \"reset_credentials\"}"}]},
]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def candidate_fingerprint(run_dir: Path, layout: str = "adapter") -> dict[str, Any]:
    """What `glmtune eval` records for the run as a candidate (glmtune/eval/models.py): the full
    checkpoint's identity; for a LoRA run the sha256 of the adapter's two files and the identity
    of the base it ran on."""
    if (run_dir / "adapter").is_dir():
        base = hf_dir_identity(run_dir / "base")
        return {"config_sha256": sha256_file(run_dir / layout / "adapter_config.json"),
                "weights_sha256": sha256_file(run_dir / layout / "adapter_model.safetensors"),
                "path": str(run_dir / layout),
                "base": {"config_sha256": base["config_sha256"], "weights_sha256": base["weights_sha256"],
                         "path": str(run_dir / "base")}}
    identity = hf_dir_identity(run_dir / "hf")
    return {"config_sha256": identity["config_sha256"], "weights_sha256": identity["weights_sha256"],
            "path": str(run_dir / "hf")}


def _metric(metric_id: str, unit: str, higher: bool, n: int, base: float, cand: float,
            categories: dict[str, tuple[int, float, float]] | None = None) -> dict[str, Any]:
    cells = {"all": (n, base, cand), **(categories or {})}
    return {"id": metric_id, "set": metric_id.split("/")[0], "scorer": metric_id.split("/")[1],
            "name": metric_id.split("/")[2], "description": metric_id, "unit": unit, "higher_is_better": higher,
            "by_category": {c: {"n": k, "values": {"base": b, "candidate": v}, "delta": {"candidate": v - b}}
                            for c, (k, b, v) in cells.items()}}


def _gate(name: str, metric: dict[str, Any], rule: str, threshold: float | None) -> dict[str, Any]:
    cell = metric["by_category"]["all"]["values"]
    value, base = cell["candidate"], cell["base"]
    higher = metric["higher_is_better"]
    passed = {"improves": (value > base) if higher else (value < base), "min": value >= (threshold or 0),
              "max": value <= (threshold or 0), "max_increase": value - base <= (threshold or 0)}[rule]
    return {"name": name, "metric": metric["id"], "category": "all", "model": "candidate", "rule": rule,
            "threshold": threshold, "value": value, "base_value": base, "passed": passed,
            "message": f"candidate {value:.3f} vs base {base:.3f}"}


def make_eval_dir(out: Path, run_dir: Path, *, exact: float = 0.4, critical: float = 0.0,
                  candidate_source: Path | None = None, fingerprint: dict[str, str] | None = None,
                  suite_text: str = SUITE_YAML) -> Path:
    """Write an eval directory for `run_dir` (base = RUN_DIR/base, candidate = the run) into `out`.

    Args:
        exact: the candidate's exact-match rate (the base's is 0.0: exact 0 fails `improves`).
        critical: the candidate's critical format failures (above 0 fails the `max` gate).
        fingerprint: the candidate's recorded fingerprint (default: the run's real one).
    """
    out.mkdir(parents=True)
    (out / "sets").mkdir()
    (out / "suite.yaml").write_text(suite_text)
    validation = sorted((run_dir / "data").glob("validation-*.jsonl"))[0]
    tickets = [json.loads(line) for line in validation.read_text().splitlines() if line]
    (out / "sets" / "tickets.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in tickets))
    (out / "sets" / "refusal.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in REFUSALS))
    n = len(tickets)
    metrics = [
        _metric("tickets/task_success/exact", "ratio", True, n, 0.0, exact,
                {"tool_call": (2, 0.0, exact / 2)}),
        _metric("tickets/format/critical_failures", "count", False, n, float(n), critical),
        _metric("tickets/tool_execution/success", "ratio", True, 2, 0.0, 1.0),
        _metric("refusal/refusal/correct", "ratio", True, 2, 0.5, 1.0),
        _metric("general_text/loss/loss", "nats_per_token", False, 12, 8.4, 8.6),
    ]
    gates = [_gate("task success improves on the base", metrics[0], "improves", None),
             _gate("zero critical format failures", metrics[1], "max", 0.0),
             _gate("tool execution", metrics[2], "min", 0.5),
             _gate("general loss budget", metrics[4], "max_increase", 0.5)]
    base_identity = hf_dir_identity(run_dir / "base")
    tokenizer_dir = run_dir / ("base" if (run_dir / "adapter").is_dir() else "hf")
    template = load_chat_template(tokenizer_dir)
    system_prompt = tickets[0]["messages"][0]["content"]
    latencies = {"base": [0.21, 0.25, 0.3], "candidate": [0.2, 0.22, 0.4]}
    scorecard = {
        "format": "glmtune.scorecard/1", "created": "2026-12-02T17:00:00+00:00",
        "glmtune": {"version": "0.1.0", "commit": None},
        "suite": {"name": "support-json", "version": "3", "path": "/abs/suite.yaml",
                  "sha256": sha256_file(out / "suite.yaml"),
                  "sets": [{"name": "tickets", "source": "run:validation", "rows": n,
                            "sha256": sha256_file(out / "sets" / "tickets.jsonl"),
                            "scorers": ["task_success", "format", "tool_execution"]},
                           {"name": "refusal", "source": "/abs/refusal.jsonl", "rows": len(REFUSALS),
                            "sha256": sha256_file(out / "sets" / "refusal.jsonl"), "scorers": ["refusal"]}]},
        "decoding": {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                     "stop_strings": [], "max_tool_rounds": 2, "batch_size": 1},
        "prompt": {"system_prompt_sha256": hashlib.sha256(system_prompt.encode()).hexdigest(),
                   "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
                   "tool_schema_sha256": hashlib.sha256(TOOL_SCHEMA.encode()).hexdigest()},
        "models": [
            {"label": "base", "role": "base", "source": str(run_dir / "base"), "kind": "hf",
             "fingerprint": {k: base_identity[k] for k in ("config_sha256", "weights_sha256")}, "merged": None},
            {"label": "candidate", "role": "candidate", "source": str(candidate_source or run_dir), "kind": "run",
             "fingerprint": fingerprint if fingerprint is not None else candidate_fingerprint(run_dir),
             "merged": False}],
        "metrics": metrics,
        "fields": [{"set": "tickets", "field": f, "n": n, "values": {"base": 0.0, "candidate": exact}}
                   for f in ("product", "severity", "next_action")],
        "operations": {label: {"requests": 3, "latency_s": lat, "p50_s": sorted(lat)[1], "p95_s": max(lat),
                               "generated_tokens": 300, "generated_tokens_per_s": 90.0, "peak_memory_gib": None,
                               "device": "cpu"} for label, lat in latencies.items()},
        "gates": gates,
        "passed": all(g["passed"] for g in gates),
        "examples": [{"set": "tickets", "id": r["id"], "category": "tool_call", "prompt": r["messages"][1]["content"],
                      "reference": r["messages"][-1]["content"],
                      "outputs": {label: {"text": "{}", "transcript": "{}", "tool_calls": [], "latency_s": 0.2,
                                          "passed": False, "failures": ["product: got None, want X"]}
                                  for label in ("base", "candidate")}} for r in tickets[:2]],
    }
    (out / "scorecard.json").write_text(json.dumps(scorecard, indent=2) + "\n")
    return out
