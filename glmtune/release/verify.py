"""`glmtune release verify release.json [--key KEYFILE]`: is every recorded artifact still exactly
what was released, and is the manifest what was written?

The manifest first: its id must still be the hash of its content (a hand-edited threshold or
score would otherwise pass unnoticed). That proves integrity only: the id is an unkeyed
hash, so whoever edits the manifest can recompute it. With `--key`, its HMAC signature must
check (glmtune/release/signing.py): a missing signature, another key or a changed byte is a
failure. Without `--key`, a signature is reported but not checked.

Then each artifact, where the manifest says it is (a relative root from the release file's
directory): an entry whose paths could lead out of it (`..`, an absolute file path, an
absolute root unless the signature checked or `--allow-outside`) or whose counts disagree
with its own file list is REFUSED and nothing of it is read; otherwise it is re-hashed file
by file (DRIFT: a missing file, a size or sha256 change, in a directory artifact a file that
was not there at release time, a link out of the release file's directory). One line per
artifact and one for the manifest; anything but ok is exit 1. Every line goes through
`printable`: manifest fields are untrusted text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.io.sizes import human_bytes
from glmtune.io.text_limits import printable
from glmtune.release.artifacts import check_artifact
from glmtune.release.manifest import load_release, release_id
from glmtune.release.signing import check_signature, read_key

_SHOWN_PROBLEMS = 5  # per line; the rest are counted
MANIFEST = "release.json"


def verify_release(path: str | Path, key_file: str | Path | None = None,
                   allow_outside: bool = False) -> dict[str, Any]:
    """{"id", "path", "clean", "manifest": problems, "signature": {"status", "key_id", "problem"},
    "artifacts": [{"name", "root", "num_files", "size", "status", "problems"}]}."""
    path = Path(path)
    key = read_key(key_file, "--key") if key_file is not None else None
    manifest, _ = load_release(path)
    manifest_dir = path.absolute().parent
    manifest_problems = []
    if manifest.get("id") != release_id(manifest):
        manifest_problems.append(f"content does not match its id {manifest.get('id')} (edited after it was written)")
    signature = check_signature(manifest, key)
    if signature["problem"]:
        manifest_problems.append(signature["problem"])
    entries = manifest.get("artifacts")
    if not isinstance(entries, list):
        manifest_problems.append("its artifacts are not a list")
        entries = []
    # An absolute root is read only when the manifest is vouched for (see paths.py).
    trusted = allow_outside or signature["status"] == "valid"
    results = []
    for i, entry in enumerate(entries):
        status, problems = check_artifact(entry, manifest_dir, allow_absolute=trusted)
        get = entry.get if isinstance(entry, dict) else {}.get
        name = get("name") if isinstance(get("name"), str) and get("name") else f"artifact {i}"
        results.append({"name": name, "root": get("root"), "num_files": get("num_files"), "size": get("size"),
                        "status": status, "problems": problems})
    clean = not manifest_problems and all(r["status"] == "ok" for r in results)
    return {"id": manifest.get("id"), "path": str(path), "clean": clean, "manifest": manifest_problems,
            "signature": signature, "artifacts": results}


def _files(count: int) -> str:
    return f"{count} file" + ("" if count == 1 else "s")


def _manifest_line(result: dict[str, Any], width: int) -> str:
    """What the manifest check proved: integrity always, authenticity only with a checked signature."""
    if result["manifest"]:
        return f"{MANIFEST:{width}}  FAILED   {'; '.join(result['manifest'])}"
    signature = result["signature"]
    proof = {"unsigned": "unsigned: integrity only (the id is an unkeyed hash that whoever edits the manifest "
                         "can recompute), not who wrote it",
             "not checked": f"signed (key id {signature['key_id']}), signature not checked: pass --key",
             "valid": f"signature valid (key id {signature['key_id']}): written by a holder of this key"}
    return f"{MANIFEST:{width}}  ok       id matches the content; {proof[signature['status']]}"


def report_lines(result: dict[str, Any]) -> list[str]:
    """The human report: the manifest's line, one line per artifact, then the verdict; every
    line printable (control characters in manifest fields shown escaped)."""
    names = [printable(r["name"]) for r in result["artifacts"]]
    width = max([len(name) for name in names] + [len(MANIFEST)])
    lines = [_manifest_line(result, width)]
    for name, r in zip(names, result["artifacts"]):
        if r["problems"]:
            shown = r["problems"][:_SHOWN_PROBLEMS]
            more = len(r["problems"]) - len(shown)
            text = "; ".join(shown) + (f"; and {more} more" if more else "")
            lines.append(f"{name:{width}}  {r['status']:7}  {r['root']}: {text}")
        else:
            size = f"{_files(r['num_files'])}, {human_bytes(r['size'])}"
            lines.append(f"{name:{width}}  ok       {r['root']} ({size})")
    bad = sum(r["status"] != "ok" for r in result["artifacts"]) + bool(result["manifest"])
    if result["clean"]:
        lines.append(f"release {result['id']}: clean ({len(result['artifacts'])} artifacts, "
                     f"{sum(r['num_files'] for r in result['artifacts'])} files)")
    else:
        refused = sum(r["status"] == "REFUSED" for r in result["artifacts"])
        lines.append(f"release {result['id']}: DRIFT in {bad} of {len(result['artifacts']) + 1} "
                     "(artifacts and the manifest)" + (f", {refused} refused unread" if refused else ""))
    return [printable(line) for line in lines]
