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
  rollback     each trigger's condition, the margin, the release it rolls back to, and
               the gated metrics left without a trigger (why)
  environment  glmtune version and commit, library versions

Manifests are untrusted: every field the diff reads goes through a typed `Fields` view (a
list where an object belongs, a string where a number belongs: one ValueError naming the file
and the field, never a traceback), and every cell and line of the table through `printable`
(an ESC in a metric name shows as `\x1b`); `--json` is escaped by json.dumps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmtune.io.sizes import human_bytes
from glmtune.io.text_limits import printable
from glmtune.release.fields import Fields
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


def _gate_key(gate: Fields) -> str:
    return f"{gate.str('name')} [{gate.str('model')}]"


def _suite(ev: Fields) -> dict[str, Any]:
    suite = ev.dict("suite")
    sets = suite.list("sets")
    return {"name": suite.scalar("name"), "version": suite.scalar("version"), "sha256": suite.str("sha256"),
            **{f"set {s.str('name')}": s.str("sha256") for s in sets},
            **{f"set {s.str('name')} rows": s.number("rows") for s in sets},
            **flatten(ev.dict("decoding").value, "decoding.")}


def _data(data: Fields) -> dict[str, Any]:
    manifest = data.dict("manifest")
    return {"manifest.sha256": manifest.str("sha256"),
            **{f"manifest.{k}": manifest.number(k)
               for k in ("train_conversations", "validation_conversations", "train_rows", "train_tokens")},
            **flatten(data.dict("sources").value, "sources."),
            "contract.sha256": data.dict("contract").str("sha256"),
            "json_schema.sha256": data.dict("json_schema").str("sha256"),
            "pii.policy": data.dict("pii").scalar("policy"),
            "approval.approved_by": data.dict("approval").str("approved_by"),
            "approval.note": data.dict("approval").str("note")}


def _trigger(t: Fields) -> tuple[str, str]:
    key = f"{t.str('metric', required=True)}@{t.str('category', required=True)}"
    return key, f"{t.str('op', required=True)} {t.number('threshold', required=True):g}"


def _projection(m: Fields) -> dict[str, dict[str, Any]]:
    """Each section (except artifacts and scores) as a flat {key: value} to compare."""
    run, base, tokenizer, ev = m.dict("run"), m.dict("base"), m.dict("tokenizer"), m.dict("eval")
    env, rollback, template = m.dict("environment"), m.dict("rollback"), m.dict("tokenizer").dict("chat_template")
    return {
        "release": {f"run.{k}": run.scalar(k) for k in ("run_id", "name", "method", "path")},
        "base": {k: base.scalar(k) for k in ("name_or_path", "preset", "seed", "revision", "revision_source",
                                             "config_sha256", "weights_sha256", "num_tensors")},
        "tokenizer": {"chat_template.source": template.scalar("source"), "chat_template.sha256": template.str("sha256"),
                      **{f"file {name}": sha for name, sha in tokenizer.dict("files").items()}},
        "engine": dict(m.dict("engine").items()),
        "prompt": dict(m.dict("prompt").items()),
        "suite": _suite(ev),
        "gates": {"passed": ev.scalar("passed"), "allowed_failed_gates": ev.scalar("allowed_failed_gates"),
                  **{_gate_key(g): f"{'passed' if g.raw('passed') else 'FAILED'} ({g.scalar('value')})"
                     for g in ev.list("gates")}},
        "config": flatten(m.dict("config").dict("resolved").value),
        "data": _data(m.dict("data")),
        "rollback": {"margin": rollback.number("margin"), "to": rollback.str("to"),
                     **dict(_trigger(t) for t in rollback.list("triggers")),
                     **{f"no trigger on {u.str('metric', required=True)}@{u.str('category', required=True)}":
                        u.str("reason", required=True) for u in rollback.list("untriggered")}},
        "environment": {"glmtune.version": env.dict("glmtune").scalar("version"),
                        "glmtune.commit": env.dict("glmtune").scalar("commit"),
                        **{f"libraries.{k}": v for k, v in env.dict("libraries").items()}},
    }


def _artifacts(m: Fields) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (its summary, {file path: sha256})."""
    out = {}
    for entry in m.list("artifacts"):
        count, size = entry.number("num_files", required=True), entry.number("size", required=True)
        files = {f.str("path", required=True): f.str("sha256", required=True) for f in entry.list("files")}
        out[entry.str("name", required=True)] = (f"{count} file{'' if count == 1 else 's'}, {human_bytes(size)}",
                                                 files)
    return out


def _artifact_changes(a: Fields, b: Fields) -> list[dict[str, Any]]:
    by_a, by_b = _artifacts(a), _artifacts(b)
    changes = []
    for name in [*by_a, *(n for n in by_b if n not in by_a)]:
        old, new = by_a.get(name), by_b.get(name)
        if old is not None and new is not None:
            files_a, files_b = old[1], new[1]
            if files_a == files_b:
                continue
            parts = ([f"{p} changed" for p in files_a if p in files_b and files_a[p] != files_b[p]]
                     + [f"{p} added" for p in files_b if p not in files_a]
                     + [f"{p} removed" for p in files_a if p not in files_b])
            detail = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
        else:
            detail = "added" if old is None else "removed"
        changes.append({"section": "artifacts", "key": name, "a": old and old[0], "b": new and new[0],
                        "delta": None, "detail": detail})
    return changes


def _score_changes(a: Fields, b: Fields) -> list[dict[str, Any]]:
    def values(m: Fields):
        return {(s.str("id", required=True), label): s.dict("values").scalar(label)
                for s in m.dict("eval").list("scores") for label, _ in s.dict("values").items()}

    va, vb = values(a), values(b)
    changes = []
    for key in [*va, *(k for k in vb if k not in va)]:
        old, new = va.get(key), vb.get(key)
        if old == new:
            continue
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
        changes.append({"section": "scores", "key": f"{key[0]} [{key[1]}]", "a": old, "b": new,
                        "delta": new - old if numeric else None, "detail": None})
    return changes


def diff_releases(path_a: str | Path, path_b: str | Path) -> dict[str, Any]:
    """{"a", "b", "chained", "changes": [{"section", "key", "a", "b", "delta", "detail"}], "unchanged": [...]}.

    Raises:
        ValueError: a file is not a release, or a field the diff reads has the wrong type (naming it).
    """
    manifest_a, sha_a = load_release(path_a, "A")
    manifest_b, sha_b = load_release(path_b, "B")
    a, b = Fields(manifest_a, f"A {path_a}"), Fields(manifest_b, f"B {path_b}")
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
    previous_b = b.dict("previous")
    chained = previous_b.str("id") == a.str("id") and previous_b.str("sha256") == sha_a
    changed_sections = {c["section"] for c in changes}
    return {"a": {"path": str(path_a), "id": a.str("id"), "created": a.scalar("created"), "sha256": sha_a},
            "b": {"path": str(path_b), "id": b.str("id"), "created": b.scalar("created"), "sha256": sha_b},
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
