"""`glmtune release verify release.json`: is every recorded artifact still exactly what was released?

Each artifact is re-hashed where the manifest says it is (a relative root from the release
file's directory) and compared file by file: a missing file, a size change, a sha256
change, and in a directory artifact a file that was not there at release time. The manifest
itself is checked too: its id must still be the hash of its content (a hand-edited threshold
or score would otherwise pass unnoticed). One line per artifact; drift anywhere is exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.io.sizes import human_bytes
from glmtune.release.artifacts import check_artifact
from glmtune.release.manifest import load_release, release_id

_SHOWN_PROBLEMS = 5  # per line; the rest are counted


def verify_release(path: str | Path) -> dict[str, Any]:
    """{"id", "clean", "manifest": problems, "artifacts": [{"name", "root", "num_files", "problems"}]}."""
    path = Path(path)
    manifest, _ = load_release(path)
    manifest_dir = path.absolute().parent
    manifest_problems = []
    if manifest.get("id") != release_id(manifest):
        manifest_problems.append(f"content does not match its id {manifest.get('id')} (edited after it was written)")
    results = []
    for entry in manifest.get("artifacts", []):
        problems = check_artifact(entry, manifest_dir)
        results.append({"name": entry["name"], "root": entry["root"], "num_files": entry["num_files"],
                        "size": entry["size"], "problems": problems})
    clean = not manifest_problems and not any(r["problems"] for r in results)
    return {"id": manifest.get("id"), "path": str(path), "clean": clean, "manifest": manifest_problems,
            "artifacts": results}


def _files(count: int) -> str:
    return f"{count} file" + ("" if count == 1 else "s")


def report_lines(result: dict[str, Any]) -> list[str]:
    """The human report: one line per artifact, then the verdict."""
    width = max([len(r["name"]) for r in result["artifacts"]] + [len("release.json")])
    lines = []
    if result["manifest"]:
        lines.append(f"{'release.json':{width}}  DRIFT  {'; '.join(result['manifest'])}")
    for r in result["artifacts"]:
        if r["problems"]:
            shown = r["problems"][:_SHOWN_PROBLEMS]
            more = len(r["problems"]) - len(shown)
            text = "; ".join(shown) + (f"; and {more} more" if more else "")
            lines.append(f"{r['name']:{width}}  DRIFT  {r['root']}: {text}")
        else:
            size = f"{_files(r['num_files'])}, {human_bytes(r['size'])}"
            lines.append(f"{r['name']:{width}}  ok     {r['root']} ({size})")
    drifted = sum(bool(r["problems"]) for r in result["artifacts"]) + bool(result["manifest"])
    if result["clean"]:
        lines.append(f"release {result['id']}: clean ({len(result['artifacts'])} artifacts, "
                     f"{sum(r['num_files'] for r in result['artifacts'])} files)")
    else:
        lines.append(f"release {result['id']}: DRIFT in {drifted} of {len(result['artifacts']) + 1} "
                     "(artifacts and the manifest)")
    return lines
