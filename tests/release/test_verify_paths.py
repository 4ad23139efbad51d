"""`glmtune release verify` reads nothing outside the release file's directory that a manifest
points at: `..` and absolute file paths, `..` roots, absolute roots (unless --allow-outside),
links out, and totals that disagree with the file list are refused or named, on hand-built
manifests, and the size and hash of a file outside never appear in the report."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.release.artifacts import record_artifact
from glmtune.release.manifest import FORMAT, release_id

SECRET_SIZE = 12345


@pytest.fixture
def layout(tmp_path) -> tuple[Path, Path, dict]:
    """(the release file's directory, a secret file outside it, a clean artifact entry)."""
    rel = tmp_path / "release"
    (rel / "model" / "sub").mkdir(parents=True)
    (rel / "model" / "weights.bin").write_bytes(b"w" * 100)
    (rel / "model" / "sub" / "config.json").write_text("{}")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(SECRET_SIZE))
    entry, _ = record_artifact("model", rel / "model", "dir", "a model", rel)
    return rel, secret, entry


def _write(rel: Path, *artifacts: dict) -> Path:
    manifest = {"format": FORMAT, "id": None, "created": "2026-12-02T00:00:00+00:00", "artifacts": list(artifacts),
                "signature": None}
    manifest["id"] = release_id(manifest)
    path = rel / "release.json"
    path.write_text(json.dumps(manifest, indent=2))
    return path


def _verify(capsys, path: Path, *options: str) -> tuple[int, dict[str, str], str]:
    code = main(["release", "verify", str(path), *options])
    out = capsys.readouterr().out
    return code, {line.split()[0]: line for line in out.splitlines()[:-1]}, out


def _leaks(out: str, secret: Path) -> bool:
    sha = hashlib.sha256(secret.read_bytes()).hexdigest()
    return str(SECRET_SIZE) in out or "12.1 KiB" in out or sha[:12] in out


def _variant(entry: dict, name: str, **changes) -> dict:
    found = copy.deepcopy(entry)
    found.update(name=name, **changes)
    return found


def test_escaping_paths_are_refused_unread(layout, capsys):
    rel, secret, entry = layout
    outside = {"path": "../secret.bin", "size": 1, "sha256": "0" * 64}  # a stat would say 12345 bytes
    dotdot = _variant(entry, "dotdot", files=[*entry["files"], outside], num_files=3, size=entry["size"] + 1)
    absolute = _variant(entry, "absolute", files=[{**outside, "path": str(secret), "size": SECRET_SIZE}],
                        num_files=1, size=SECRET_SIZE)
    as_file = _variant(entry, "as_file", kind="file", root="../secret.bin",
                       files=[{**outside, "path": "secret.bin"}], num_files=1, size=1)
    absolute_root = _variant(entry, "absolute_root", kind="file", root=str(secret),
                             files=[{**outside, "path": "secret.bin"}], num_files=1, size=1)
    code, lines, out = _verify(capsys, _write(rel, entry, dotdot, absolute, as_file, absolute_root))
    assert code == 1 and " ok " in lines["model"], out
    assert "REFUSED" in lines["dotdot"] and "'../secret.bin' has an empty, '.' or '..' component" in lines["dotdot"]
    assert "REFUSED" in lines["absolute"] and "is absolute" in lines["absolute"]
    assert "REFUSED" in lines["as_file"] and "root '../secret.bin' has a '..' component" in lines["as_file"]
    assert "REFUSED" in lines["absolute_root"] and "absolute root, outside the manifest's directory" in out
    assert out.splitlines()[-1].endswith("DRIFT in 4 of 6 (artifacts and the manifest), 4 refused unread")
    assert not _leaks(out, secret), out

    # --allow-outside trusts an absolute root, never a file path that climbs out of it.
    code, lines, out = _verify(capsys, rel / "release.json", "--allow-outside")
    assert "DRIFT" in lines["absolute_root"] and "secret.bin size changed (1 -> 12345 bytes)" in out
    assert "REFUSED" in lines["dotdot"] and "REFUSED" in lines["absolute"]


def test_links_out_are_named_not_followed(layout, capsys):
    rel, secret, entry = layout
    path = _write(rel, entry)
    (rel / "model" / "weights.bin").unlink()
    (rel / "model" / "weights.bin").symlink_to(secret)  # a recorded file replaced by a link out
    (rel / "model" / "peek").symlink_to(secret.parent, target_is_directory=True)  # a directory link out
    (rel / "model" / "loop").symlink_to(rel / "model", target_is_directory=True)  # a loop inside
    (rel / "model" / "inside.bin").symlink_to(rel / "model" / "sub" / "config.json")  # inside: followed
    code, lines, out = _verify(capsys, path)
    tree = os.path.realpath(rel)
    assert code == 1 and "DRIFT" in lines["model"], out
    assert f"weights.bin leads out of {tree} (a link; not read)" in out
    assert f"peek/ leads out of {tree} (a link; not followed)" in out
    assert "loop/ loops back to a directory above it" in out
    assert "inside.bin is new (not recorded)" in out and "peek/secret.bin" not in out
    assert not _leaks(out, secret), out

    # The artifact's root itself a link out of the release file's directory.
    moved = rel.parent / "elsewhere"
    (rel / "model").rename(moved)
    (rel / "model").symlink_to(moved, target_is_directory=True)
    code, lines, out = _verify(capsys, path)
    assert code == 1 and f"model leads out of {tree} (a link; not read)" in lines["model"], out


def test_totals_and_entries_must_agree_with_the_file_list(layout, capsys):
    rel, _, entry = layout
    count = _variant(entry, "count", num_files=3)
    size = _variant(entry, "size", size=entry["size"] + 7)
    one_file = _variant(entry, "one_file", kind="file", root="model/weights.bin")  # lists two files
    malformed = {"name": "malformed", "kind": "dir", "root": "model", "files": "everything"}
    code, lines, out = _verify(capsys, _write(rel, entry, count, size, one_file, malformed, "not an entry"))
    assert code == 1 and " ok " in lines["model"], out
    assert "REFUSED" in lines["count"] and "num_files 3 is not the 2 files it lists" in lines["count"]
    assert "REFUSED" in lines["size"] and f"size {entry['size'] + 7} is not the sum of its files' sizes" in out
    assert "a one-file artifact must list exactly its root's file" in lines["one_file"]
    assert "files is not a list of file entries" in lines["malformed"]
    assert "REFUSED" in lines["artifact"] and "not an artifact entry" in lines["artifact"]
