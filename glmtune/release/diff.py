"""`glmtune release diff A.json B.json`: what changed between two releases.

Compared section by section, only what differs is listed (one row each: section, key, A, B,
and for scores the delta B - A):
  release      ids, runs, and whether B names A as its previous release
  base         name, preset, revision, config and weight hashes
  artifacts    per artifact: added, removed, or which files changed (by sha256)
  tokenizer    the chat template (source, hash) and each tokenizer file's hash
  engine       name, version
  prompt       system prompt, tool schema and eval-time chat template hashes
  suite        name, version, sha256, each set's sha256, the decoding settings
  scores       every metric (category "all") per model label, with the delta
  gates        each gate's verdict and value, and the overall verdict
  config       the resolved training config, flattened to dotted keys
  data         data manifest, counts, contract, schema, PII policy, sources, approval
  rollback     each trigger's condition, the margin, the release it rolls back to
  environment  glmtune version and commit, library versions

Manifests are untrusted text: every cell and line of the table goes through `printable`
(an ESC in a metric name shows as `\x1b`); `--json` is escaped by json.dumps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmtune.io.sizes import human_bytes
from glmtune.io.text_limits import printable
from glmtune.release.manifest import load_release

SECTIONS = ("release", "base", "artifacts", "tokenizer", "engine", "prompt", "suite", "scores", "gates", "config",
            "data", "rollback", "environment")
_MAX_CELL = 44


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {"a.b.c": leaf}; lists are leaves (compared whole)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value} if prefix else {}


def _gate_key(gate: dict[str, Any]) -> str:
    return f"{gate.get('name')} [{gate.get('model')}]"


def _projection(m: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each section (except artifacts and scores) as a flat {key: value} to compare."""
    base, tokenizer, ev, data = m.get("base") or {}, m.get("tokenizer") or {}, m.get("eval") or {}, m.get("data") or {}
    suite = ev.get("suite") or {}
    env = m.get("environment") or {}
    rollback = m.get("rollback") or {}
    return {
        "release": {"run.run_id": (m.get("run") or {}).get("run_id"), "run.name": (m.get("run") or {}).get("name"),
                    "run.method": (m.get("run") or {}).get("method"), "run.path": (m.get("run") or {}).get("path")},
        "base": {k: base.get(k) for k in ("name_or_path", "preset", "seed", "revision", "revision_source",
                                          "config_sha256", "weights_sha256", "num_tensors")},
        "tokenizer": {"chat_template.source": (tokenizer.get("chat_template") or {}).get("source"),
                      "chat_template.sha256": (tokenizer.get("chat_template") or {}).get("sha256"),
                      **{f"file {name}": sha for name, sha in (tokenizer.get("files") or {}).items()}},
        "engine": dict(m.get("engine") or {}),
        "prompt": dict(m.get("prompt") or {}),
        "suite": {"name": suite.get("name"), "version": suite.get("version"), "sha256": suite.get("sha256"),
                  **{f"set {s.get('name')}": s.get("sha256") for s in suite.get("sets", [])},
                  **{f"set {s.get('name')} rows": s.get("rows") for s in suite.get("sets", [])},
                  **flatten(ev.get("decoding") or {}, "decoding.")},
        "gates": {"passed": ev.get("passed"), "allowed_failed_gates": ev.get("allowed_failed_gates"),
                  **{_gate_key(g): f"{'passed' if g.get('passed') else 'FAILED'} ({g.get('value')})"
                     for g in ev.get("gates", [])}},
        "config": flatten((m.get("config") or {}).get("resolved") or {}),
        "data": {"manifest.sha256": (data.get("manifest") or {}).get("sha256"),
                 **{f"manifest.{k}": (data.get("manifest") or {}).get(k)
                    for k in ("train_conversations", "validation_conversations", "train_rows", "train_tokens")},
                 **flatten(data.get("sources") or {}, "sources."),
                 "contract.sha256": (data.get("contract") or {}).get("sha256"),
                 "json_schema.sha256": (data.get("json_schema") or {}).get("sha256"),
                 "pii.policy": (data.get("pii") or {}).get("policy"),
                 "approval.approved_by": (data.get("approval") or {}).get("approved_by"),
                 "approval.note": (data.get("approval") or {}).get("note")},
        "rollback": {"margin": rollback.get("margin"), "to": rollback.get("to"),
                     **{f"{t['metric']}@{t['category']}": f"{t['op']} {t['threshold']:g}"
                        for t in rollback.get("triggers", [])}},
        "environment": {"glmtune.version": (env.get("glmtune") or {}).get("version"),
                        "glmtune.commit": (env.get("glmtune") or {}).get("commit"),
                        **{f"libraries.{k}": v for k, v in (env.get("libraries") or {}).items()}},
    }


def _artifact_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    def summary(entry):
        if entry is None:
            return None
        return f"{entry['num_files']} file{'' if entry['num_files'] == 1 else 's'}, {human_bytes(entry['size'])}"

    by_a = {x["name"]: x for x in a.get("artifacts", [])}
    by_b = {x["name"]: x for x in b.get("artifacts", [])}
    changes = []
    for name in [*by_a, *(n for n in by_b if n not in by_a)]:
        old, new = by_a.get(name), by_b.get(name)
        if old is not None and new is not None:
            files_a = {f["path"]: f["sha256"] for f in old["files"]}
            files_b = {f["path"]: f["sha256"] for f in new["files"]}
            if files_a == files_b:
                continue
            parts = ([f"{p} changed" for p in files_a if p in files_b and files_a[p] != files_b[p]]
                     + [f"{p} added" for p in files_b if p not in files_a]
                     + [f"{p} removed" for p in files_a if p not in files_b])
            detail = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
        else:
            detail = "added" if old is None else "removed"
        changes.append({"section": "artifacts", "key": name, "a": summary(old), "b": summary(new), "delta": None,
                        "detail": detail})
    return changes


def _score_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    def values(m):
        return {(s["id"], label): v for s in (m.get("eval") or {}).get("scores", [])
                for label, v in (s.get("values") or {}).items()}

    va, vb = values(a), values(b)
    changes = []
    for key in [*va, *(k for k in vb if k not in va)]:
        old, new = va.get(key), vb.get(key)
        if old == new:
            continue
        numeric = isinstance(old, (int, float)) and isinstance(new, (int, float))
        changes.append({"section": "scores", "key": f"{key[0]} [{key[1]}]", "a": old, "b": new,
                        "delta": new - old if numeric else None, "detail": None})
    return changes


def diff_releases(path_a: str | Path, path_b: str | Path) -> dict[str, Any]:
    """{"a", "b", "chained", "changes": [{"section", "key", "a", "b", "delta", "detail"}], "unchanged": [...]}."""
    a, sha_a = load_release(path_a, "A")
    b, sha_b = load_release(path_b, "B")
    changes = []
    proj_a, proj_b = _projection(a), _projection(b)
    for section in SECTIONS:
        if section == "artifacts":
            changes += _artifact_changes(a, b)
        elif section == "scores":
            changes += _score_changes(a, b)
        else:
            old, new = proj_a[section], proj_b[section]
            for key in [*old, *(k for k in new if k not in old)]:
                if old.get(key) != new.get(key):
                    changes.append({"section": section, "key": key, "a": old.get(key), "b": new.get(key),
                                    "delta": None, "detail": None})
    previous_b = b.get("previous") or {}
    chained = previous_b.get("id") == a.get("id") and previous_b.get("sha256") == sha_a
    changed_sections = {c["section"] for c in changes}
    return {"a": {"path": str(path_a), "id": a.get("id"), "created": a.get("created"), "sha256": sha_a},
            "b": {"path": str(path_b), "id": b.get("id"), "created": b.get("created"), "sha256": sha_b},
            "chained": chained, "changes": changes,
            "unchanged": [s for s in SECTIONS if s not in changed_sections]}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    text = printable(value if isinstance(value, str) else json.dumps(value))
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12] + "…"  # a sha256: the prefix tells them apart
    return text if len(text) <= _MAX_CELL else text[:_MAX_CELL - 1] + "…"


def report_lines(result: dict[str, Any]) -> list[str]:
    """The human table, every line printable."""
    a, b = result["a"], result["b"]
    lines = [f"A: release {a['id']} ({a['created']}) {a['path']}", f"B: release {b['id']} ({b['created']}) {b['path']}"]
    lines.append(f"B {'names' if result['chained'] else 'does not name'} A as its previous release")
    rows = [("section", "key", "A", "B", "change")]
    for c in result["changes"]:
        note = f"{c['delta']:+.4g}" if c["delta"] is not None else (c["detail"] or "")
        rows.append((c["section"], printable(c["key"]), _cell(c["a"]), _cell(c["b"]), printable(note)))
    if len(rows) == 1:
        lines.append("no differences")
    else:
        widths = [min(max(len(r[i]) for r in rows), _MAX_CELL) for i in range(4)]
        for r in rows:
            lines.append("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4])
    if result["unchanged"]:
        lines.append(f"unchanged: {', '.join(result['unchanged'])}")
    return [printable(line) for line in lines]
