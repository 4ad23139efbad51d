"""Which revision of the code and of a model a command ran with: what preflight, eval and release record.

  * `glmtune_pin`: glmtune's version and, in a git checkout, its commit (`git rev-parse HEAD`
    of the checkout it runs from) and whether the tree has changes (with the number of changed
    or untracked files); outside a git checkout the package version is the pin;
  * `model_revision`: the revision a downloaded HF directory records, if any: an HF cache
    snapshot's commit, huggingface-cli's `.cache/huggingface/download/config.json.metadata`,
    or a git checkout's HEAD.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from glmtune.io.regular import open_regular
from glmtune.io.version import __version__

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the glmtune package


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def glmtune_pin() -> dict[str, Any]:
    """glmtune's version and, in a git checkout, its commit and whether the tree has changes."""
    root = SOURCE_ROOT
    pin: dict[str, Any] = {"version": __version__, "source": str(root)}
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel")).resolve()
        changed = _git(root, "status", "--porcelain").splitlines() if top == root else None
    except (OSError, subprocess.SubprocessError):
        changed = None
    if changed is None:
        return {**pin, "commit": None, "note": "not a git checkout: the package version is the pin"}
    return {**pin, "commit": _git(root, "rev-parse", "HEAD"), "dirty": bool(changed), "changed_files": len(changed)}


def model_revision(path: Path) -> tuple[str | None, str]:
    """(revision, where it was read) of a downloaded HF directory; (None, why) when none is recorded."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and _COMMIT_RE.match(resolved.name):
        return resolved.name, "HF cache snapshot directory"
    metadata = path / ".cache" / "huggingface" / "download" / "config.json.metadata"
    if metadata.is_file():
        with open_regular(metadata, "download record") as fh:  # three short lines; read no more than that
            first = fh.read(4096).decode("utf-8", errors="replace").splitlines()[:1]
        if first and _COMMIT_RE.match(first[0].strip()):
            return first[0].strip(), str(metadata)
    if (path / ".git").exists():
        try:
            return _git(path, "rev-parse", "HEAD"), "git checkout"
        except (OSError, subprocess.SubprocessError):
            pass
    return None, "no download metadata (HF cache snapshot, .cache/huggingface, .git): the config hash is the pin"
