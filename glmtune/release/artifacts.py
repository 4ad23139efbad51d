"""Artifacts of a release: what ships, recorded file by file (relative path, size, sha256).

    {"name": "adapter", "kind": "dir", "root": "adapter", "what": "LoRA adapter (PEFT layout)",
     "num_files": 3, "size": 1052184,
     "files": [{"path": "adapter_config.json", "size": 1093, "sha256": "..."}, ...]}

Three kinds, so `glmtune release verify` knows what counts as drift:
  * "dir": every file under `root` (recursively). A file that appears later is drift: a
    directory a serving engine loads picks up new files (a stray shard, another template).
    Hidden entries (names starting with ".", e.g. `.git`, `.cache/huggingface`, a lock or a
    half-written `.tmp` file) are not part of the artifact and are skipped at both ends.
  * "files": the listed files of `root` only (the tokenizer files of a model directory,
    which the model directory's own artifact also covers).
  * "file": `root` is one file.

`root` is stored relative to the release file's directory when it lies inside it (a run
directory that holds its release can be moved or copied as a whole), absolute otherwise.
Symlinks are followed (an HF cache snapshot is a directory of links into `blobs/`).

Files are read in 8 MiB chunks (memory stays bounded for a 5 GB shard), several files at
once in a thread pool: hashlib and file reads release the GIL. A safetensors shard can be
hashed for its tensors in the same pass (`TensorRange`), so recording a base model's shard
hashes and its tensor identity (glmtune/io/fingerprint.py) reads each byte once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

_CHUNK_BYTES = 8 << 20
KINDS = ("dir", "files", "file")


class TensorRange(NamedTuple):
    """One tensor's bytes in a safetensors file: [start, end) from the start of the file."""

    name: str
    start: int
    end: int


def _num_threads() -> int:
    return min(8, os.cpu_count() or 1)


def hash_file(path: Path, tensors: Iterable[TensorRange] = ()) -> tuple[int, str, dict[str, str]]:
    """(size, sha256 of the file, {tensor name: sha256 of its bytes}) in one streaming pass."""
    ranges = sorted(tensors, key=lambda r: r.start)
    digest = hashlib.sha256()
    tensor_digests = {r.name: hashlib.sha256() for r in ranges}
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
            begin, end = size, size + len(chunk)
            # Tensors are contiguous and sorted; only those overlapping this chunk get bytes.
            for r in ranges:
                if r.start >= end:
                    break
                if r.end > begin:
                    tensor_digests[r.name].update(chunk[max(r.start, begin) - begin:min(r.end, end) - begin])
            size = end
    for r in ranges:
        if r.end > size:
            raise ValueError(f"{path}: truncated safetensors file (ends at byte {size}, tensor {r.name} "
                             f"needs {r.end})")
    return size, digest.hexdigest(), {name: d.hexdigest() for name, d in tensor_digests.items()}


def list_files(root: Path) -> list[str]:
    """Relative posix paths of every non-hidden file under `root`, sorted."""
    found = []
    for directory, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = Path(directory, name)
            if not name.startswith(".") and path.is_file():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def stored_root(root: Path, manifest_dir: Path) -> str:
    """How the manifest names `root` (see the module docstring)."""
    root, manifest_dir = Path(os.path.abspath(root)), Path(os.path.abspath(manifest_dir))
    if root == manifest_dir or manifest_dir in root.parents:
        return root.relative_to(manifest_dir).as_posix() or "."
    return str(root)


def resolve_root(stored: str, manifest_dir: Path) -> Path:
    return Path(stored) if os.path.isabs(stored) else Path(manifest_dir, stored)


def record_artifact(name: str, root: Path, kind: str, what: str, manifest_dir: Path,
                    files: list[str] | None = None,
                    tensors: Callable[[str], list[TensorRange]] | None = None) -> tuple[dict[str, Any], dict]:
    """Hash an artifact; returns (its manifest entry, {relative path: {tensor: sha256}}).

    Args:
        kind: "dir", "files" (then `files` names them) or "file".
        what: one phrase for people reading the manifest.
        tensors: relative path -> the tensor ranges to hash in the same pass (safetensors).
    """
    assert kind in KINDS, kind
    root = Path(root)
    if kind == "file":
        if not root.is_file():
            raise FileNotFoundError(f"{what}: {root} is missing")
        rel_paths, base = [root.name], root.parent
    else:
        if not root.is_dir():
            raise FileNotFoundError(f"{what}: directory {root} is missing")
        rel_paths, base = (list_files(root) if kind == "dir" else sorted(files or [])), root
        if not rel_paths:
            raise ValueError(f"{what}: {root} holds no files")

    def one(rel: str) -> tuple[int, str, dict[str, str]]:
        return hash_file(base / rel, tensors(rel) if tensors else ())

    with ThreadPoolExecutor(_num_threads()) as pool:
        results = dict(zip(rel_paths, pool.map(one, rel_paths)))
    entries = [{"path": rel, "size": size, "sha256": sha} for rel, (size, sha, _) in results.items()]
    entry = {"name": name, "kind": kind, "root": stored_root(root, manifest_dir), "what": what,
             "num_files": len(entries), "size": sum(e["size"] for e in entries), "files": entries}
    return entry, {rel: result[2] for rel, result in results.items() if result[2]}


def check_artifact(entry: dict[str, Any], manifest_dir: Path) -> list[str]:
    """Every way the artifact on disk differs from its manifest entry, one phrase each ([] if none)."""
    root = resolve_root(entry["root"], manifest_dir)
    kind = entry["kind"]
    base = root.parent if kind == "file" else root
    if kind == "file" and not root.is_file():
        return [f"{root} is missing"]
    if kind != "file" and not root.is_dir():
        return [f"directory {root} is missing"]
    recorded = {f["path"]: f for f in entry["files"]}
    present = [rel for rel in recorded if (base / rel).is_file()]
    problems = [f"{rel} is missing" for rel in recorded if rel not in present]

    def current(rel: str) -> tuple[int, str]:
        path = base / rel
        size = path.stat().st_size
        if size != recorded[rel]["size"]:  # no need to read it: it changed
            return size, ""
        return size, hash_file(path)[1]

    with ThreadPoolExecutor(_num_threads()) as pool:
        for rel, (size, sha) in zip(present, pool.map(current, present)):
            want = recorded[rel]
            if size != want["size"]:
                problems.append(f"{rel} size changed ({want['size']} -> {size} bytes)")
            elif sha != want["sha256"]:
                problems.append(f"{rel} sha256 changed ({want['sha256'][:12]}… -> {sha[:12]}…)")
    if kind == "dir":
        problems += [f"{rel} is new (not recorded)" for rel in list_files(root) if rel not in recorded]
    return problems


def read_format_json(path: Path, expected: str, label: str, hint: str = "") -> tuple[Any, bytes]:
    """A JSON record whose "format" must be `expected` (a scorecard, a release): (its content, its
    bytes). `label` starts each one-line ValueError (the option and path the user gave); `hint`
    ends the wrong-format one."""
    raw = path.read_bytes()
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{label}: not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != expected:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{label}: format {found!r}, expected {expected!r}{hint}")
    return record, raw
