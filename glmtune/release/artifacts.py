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
Symlinks are followed (an HF cache snapshot is a directory of links into `blobs/`), except
out of the release file's directory under a relative root: recording refuses such a link,
verify names it and reads nothing behind it (glmtune/release/paths.py). Verify also refuses
an entry whose paths could lead out (`..`, an absolute file path, an absolute root unless the
user vouches for the manifest) or whose `num_files` and `size` are not its file list's.
Every file is a regular file: recording refuses a FIFO, socket, device or link to nothing
(listed in a directory, named in a file list, or the root of a one-file artifact) and verify
reports one as DRIFT; files are opened without blocking (`glmtune.io.regular.open_regular`).

Files are read in 8 MiB chunks (memory stays bounded for a 5 GB shard), several files at
once in a thread pool: hashlib and file reads release the GIL. A safetensors shard can be
hashed for its tensors in the same pass (`TensorRange`), so recording a base model's shard
hashes and its tensor identity (glmtune/checkpoint/fingerprint.py) reads each byte once.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from glmtune.io.text_limits import parse_json
from glmtune.io.regular import kind_of, open_regular
from glmtune.release.paths import file_path_problem, is_link_refusal, not_regular, root_problem, walk, within

_CHUNK_BYTES = 8 << 20
KINDS = ("dir", "files", "file")
MAX_JSON_BYTES = 64 << 20  # a manifest, scorecard or data manifest; far above any real one
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_KEEP_INSIDE = ("what a release records under a relative root must lie inside the release file's directory "
                "(verify reads nothing outside it): copy the target in, or write the release elsewhere (--out)")


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
    with open_regular(path) as fh:  # a FIFO swapped in is refused, never waited on
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


def stored_root(root: Path, manifest_dir: Path) -> str:
    """How the manifest names `root` (see the module docstring)."""
    root, manifest_dir = Path(os.path.abspath(root)), Path(os.path.abspath(manifest_dir))
    if root == manifest_dir or manifest_dir in root.parents:
        return root.relative_to(manifest_dir).as_posix() or "."
    return str(root)


def resolve_root(stored: str, manifest_dir: Path) -> Path:
    return Path(stored) if os.path.isabs(stored) else Path(manifest_dir, stored)


def _recorded_paths(root: Path, kind: str, files: list[str] | None, what: str,
                    tree: str | None) -> tuple[list[str], Path]:
    """(the relative paths to record, the directory they are relative to); a link out of
    `tree` (the manifest's directory, for a relative root) is refused, naming it."""
    if tree is not None and not within(root, tree):
        raise ValueError(f"{what}: {root} leads out of {tree} (a link): {_KEEP_INSIDE}")
    if kind == "file":
        found = kind_of(root)
        if found == "missing":
            raise FileNotFoundError(f"{what}: {root} is missing")
        rel_paths, base = [root.name], root.parent
        refused = {} if found is None else {root.name: not_regular(root.name, found)}
    else:
        if not root.is_dir():
            raise FileNotFoundError(f"{what}: directory {root} is missing")
        if kind == "dir":
            rel_paths, refused = walk(root, tree)
        else:
            rel_paths = sorted(files or [])
            refused = {rel: not_regular(rel, found) for rel in rel_paths if (found := kind_of(root / rel))}
        base = root
        if not rel_paths and not refused:
            raise ValueError(f"{what}: {root} holds no files")
    if tree is not None:
        refused.update({rel: f"{rel} leads out of {tree} (a link)" for rel in rel_paths
                        if rel not in refused and not within(base / rel, tree)})
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        first = next(iter(refused.values()))
        raise ValueError(f"{what}: {base}: {first}{more}" + (f": {_KEEP_INSIDE}" if is_link_refusal(first) else ""))
    return rel_paths, base


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
    stored = stored_root(root, manifest_dir)
    tree = None if os.path.isabs(stored) else os.path.realpath(manifest_dir)
    rel_paths, base = _recorded_paths(root, kind, files, what, tree)

    def one(rel: str) -> tuple[int, str, dict[str, str]]:
        return hash_file(base / rel, tensors(rel) if tensors else ())

    with ThreadPoolExecutor(_num_threads()) as pool:
        results = dict(zip(rel_paths, pool.map(one, rel_paths)))
    entries = [{"path": rel, "size": size, "sha256": sha} for rel, (size, sha, _) in results.items()]
    entry = {"name": name, "kind": kind, "root": stored, "what": what,
             "num_files": len(entries), "size": sum(e["size"] for e in entries), "files": entries}
    return entry, {rel: result[2] for rel, result in results.items() if result[2]}


def entry_problems(entry: Any, allow_absolute: bool) -> list[str]:
    """Why a manifest's artifact entry cannot be checked as it stands, one phrase each ([] if
    none); nothing on disk is looked at. See glmtune/release/paths.py."""
    if not isinstance(entry, dict):
        return ["not an artifact entry (a JSON object)"]
    kind, root, files = entry.get("kind"), entry.get("root"), entry.get("files")
    problems = [] if isinstance(entry.get("name"), str) and entry["name"] else ["name is not a string"]
    if kind not in KINDS:
        problems.append(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    problems += [p for p in [root_problem(root, allow_absolute)] if p]
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        return problems + ["files is not a list of file entries"]
    paths = [f.get("path") for f in files]
    problems += [p for p in map(file_path_problem, paths) if p]
    if len(set(map(str, paths))) != len(paths):
        problems.append("a file path is listed twice")
    sizes = [f.get("size") for f in files]
    if not all(type(size) is int and size >= 0 for size in sizes):
        problems.append("a file size is not a whole number of bytes")
    elif entry.get("size") != sum(sizes):
        problems.append(f"size {entry.get('size')!r} is not the sum of its files' sizes ({sum(sizes)})")
    if entry.get("num_files") != len(files):
        problems.append(f"num_files {entry.get('num_files')!r} is not the {len(files)} files it lists")
    if not all(isinstance(f.get("sha256"), str) and _SHA256.match(f["sha256"]) for f in files):
        problems.append("a file's sha256 is not 64 hex digits")
    if kind == "file" and isinstance(root, str) and paths != [root.rsplit("/", 1)[-1]]:
        problems.append("a one-file artifact must list exactly its root's file")
    return problems


def check_artifact(entry: dict[str, Any], manifest_dir: Path, *,
                   allow_absolute: bool = False) -> tuple[str, list[str]]:
    """("ok" | "DRIFT" | "REFUSED", every problem, one phrase each).

    REFUSED: the entry itself is unsafe or inconsistent (`entry_problems`) and nothing on
    disk was read. DRIFT: the files differ from the entry (missing, size or sha256
    changed, new in a directory artifact, a link out of the manifest's directory).
    """
    refused = entry_problems(entry, allow_absolute)
    if refused:
        return "REFUSED", refused
    problems = _disk_problems(entry, manifest_dir)
    return ("DRIFT" if problems else "ok"), problems


def _disk_problems(entry: dict[str, Any], manifest_dir: Path) -> list[str]:
    root = resolve_root(entry["root"], manifest_dir)
    tree = None if os.path.isabs(entry["root"]) else os.path.realpath(manifest_dir)
    if tree is not None and not within(root, tree):
        return [f"{entry['root']} leads out of {tree} (a link; not read)"]
    kind = entry["kind"]
    base = root.parent if kind == "file" else root
    if kind == "file" and kind_of(root) == "missing":
        return [f"{root} is missing"]
    if kind != "file" and not root.is_dir():
        return [f"directory {root} is missing"]
    recorded = {f["path"]: f for f in entry["files"]}
    problems, present = [], []
    for rel in recorded:
        found = None if tree is None or within(base / rel, tree) else "out"
        found = found or kind_of(base / rel)
        if found is None:
            present.append(rel)
        elif found == "out":
            problems.append(f"{rel} leads out of {tree} (a link; not read)")
        else:
            problems.append(f"{rel} is missing" if found == "missing" else not_regular(rel, found))

    with ThreadPoolExecutor(_num_threads()) as pool:
        for rel, (size, sha, problem) in zip(present, pool.map(lambda rel: _current(base / rel, recorded[rel]),
                                                               present)):
            want = recorded[rel]
            if problem:
                problems.append(f"{rel}: {problem}")
            elif size != want["size"]:
                problems.append(f"{rel} size changed ({want['size']} -> {size} bytes)")
            elif sha != want["sha256"]:
                problems.append(f"{rel} sha256 changed ({want['sha256'][:12]}… -> {sha[:12]}…)")
    if kind == "dir":
        found, refused = walk(root, tree)
        problems += [f"{rel} is new (not recorded)" for rel in found if rel not in recorded]
        problems += [why for rel, why in refused.items() if rel not in recorded]
    return problems


def _current(path: Path, recorded: dict[str, Any]) -> tuple[int, str, str]:
    """(size, sha256 or "" when the size alone shows a change, a problem or "") of a recorded file now;
    a file replaced by a FIFO or removed since it was listed is a problem, not a wait or a traceback."""
    try:
        size = path.stat().st_size
        if size != recorded["size"]:  # no need to read it: it changed
            return size, "", ""
        return size, hash_file(path)[1], ""
    except (OSError, ValueError) as exc:
        return 0, "", getattr(exc, "strerror", None) or str(exc)


def read_json(path: Path, what: str, max_bytes: int = MAX_JSON_BYTES) -> tuple[Any, bytes]:
    """(the JSON in `path`, its bytes), its size and nesting bounded: a ValueError naming `what`
    instead of a RecursionError or a file read whole into memory."""
    with open_regular(path, what) as fh:  # a FIFO would block the read
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{what}: {size:,} bytes, more than the {max_bytes:,} a JSON record may have")
        raw = fh.read(max_bytes + 1)
    return parse_json(raw, what, max_bytes=max_bytes), raw


def read_format_json(path: Path, expected: str, label: str, hint: str = "") -> tuple[Any, bytes]:
    """A JSON record whose "format" must be `expected` (a scorecard, a release): (its content, its
    bytes). `label` starts each one-line ValueError (the option and path the user gave); `hint`
    ends the wrong-format one."""
    record, raw = read_json(path, label)
    if not isinstance(record, dict) or record.get("format") != expected:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{label}: format {found!r}, expected {expected!r}{hint}")
    return record, raw
