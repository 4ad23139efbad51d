"""Check 2: every shard of the checkpoint present and intact, and room on disk for what follows.

An HF directory is verified by `glmtune.checkpoint.hf_verify.verify_checkpoint` (what
`glmtune inspect DIR --verify` runs): every shard the index names exists, each header
parses, index and headers agree, each file's size is its header's data end, every tensor
the config implies is there with its shape and dtype, and nothing else is. Headers say
nothing about the bytes after them, so where the download recorded a shard's sha256 (an
HF cache blob's name, or the LFS etag in huggingface-cli's
`.cache/huggingface/download/NAME.metadata`) the file is hashed and compared; without a
recorded hash the evidence says the bytes were not verified. Every shard is covered,
whatever `--layers` the later checks use; a file name in the index that leads out of the
directory (`glmtune.checkpoint.shard_paths`) is a failure `verify_checkpoint` names, and that
file is never hashed. A preset has no shards: its weights are built.

Disk space (`glmtune.checkpoint.space.check_free_space`): the source is on disk already
(its size is reported); the working copy is what the preflight's scratch runs write under
OUT/work (four training checkpoints of the scratch model and one export); the outputs are
what the recipe's own run writes: one checkpoint of the whole model (keep_last + 1 at once
while saving) and, for full fine-tuning with `checkpoint.export_hf`, the HF export. Fails
when the first checkpoint (and export) cannot fit; a later save that may not fit is a
warning in the evidence.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from glmtune.checkpoint.hf_io import INDEX_NAME, SINGLE_NAME
from glmtune.config.validate import planned_saves
from glmtune.checkpoint.integrity import file_digest
from glmtune.checkpoint.space import check_free_space, checkpoint_bytes, export_bytes
from glmtune.checkpoint.hf_verify import verify_checkpoint
from glmtune.checkpoint.shard_paths import outside_reason, view_source
from glmtune.io.json_file import read_json_file
from glmtune.io.regular import open_regular
from glmtune.io.sizes import human_bytes
from glmtune.models.registry import model_args
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.preflight.trainable import transformed_meta_model

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
NUM_SCRATCH_CHECKPOINTS = 4  # reference, resume (two), multi-process
_MAX_INDEX_BYTES = 256 << 20  # as the loader reads an index
_MAX_METADATA_BYTES = 4096  # a download record is three short lines


def _download_record(metadata: Path) -> list[str]:
    """The first lines of huggingface-cli's `.metadata` file (commit, etag, time), read bounded."""
    with open_regular(metadata, "download record") as fh:
        return fh.read(_MAX_METADATA_BYTES).decode("utf-8", errors="replace").splitlines()[:2]


def recorded_sha256(path: Path, name: str) -> tuple[str | None, str]:
    """(sha256, where) the download recorded for shard `name`, or (None, why not)."""
    link = path / name
    if link.is_symlink():
        target = Path(os.readlink(link))
        if target.parent.name == "blobs" and _SHA256_RE.match(target.name):
            return target.name, "HF cache blob name"
    metadata = path / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    if metadata.is_file():
        lines = _download_record(metadata)
        if len(lines) > 1 and _SHA256_RE.match(lines[1].strip()):
            return lines[1].strip(), str(metadata)
    return None, "no recorded hash"


def shard_names(path: Path) -> list[str]:
    """The shard files of the checkpoint in `path` that its index keeps inside it (`shard_paths`): a
    name that leads out is never opened or hashed here (`verify_checkpoint` reports it)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            parsed = read_json_file(index, max_bytes=_MAX_INDEX_BYTES)
            names = set(parsed["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return []  # verify_checkpoint reports the index
        source = view_source(parsed)
        return sorted(n for n in names if isinstance(n, str) and outside_reason(path, n, source) is None)
    return [SINGLE_NAME] if (path / SINGLE_NAME).is_file() and outside_reason(path, SINGLE_NAME) is None else []


def hash_problems(path: Path, hash_shards: bool) -> tuple[list[str], dict[str, Any]]:
    """Recorded hashes compared with the files' (each file read once)."""
    problems, per_file = [], {}
    for name in shard_names(path):
        recorded, where = recorded_sha256(path, name)
        if recorded is None or not (path / name).is_file() or not hash_shards:
            per_file[name] = where if hash_shards else "not hashed (--no-shard-hashes)"
            continue
        actual = file_digest(path / name)["sha256"]
        per_file[name] = {"recorded": recorded, "actual": actual, "source": where}
        if actual != recorded:
            problems.append(f"{name}: sha256 {actual[:12]}… differs from the download's {recorded[:12]}… "
                            f"({where}): the file is corrupt")
    return problems, per_file


def _free(path: Path) -> int:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def space_problems(pf: Preflight) -> tuple[list[str], dict[str, Any]]:
    """Room for the scratch runs under OUT/work and for the recipe's own run."""
    cfg, problems, evidence = pf.cfg, [], {}
    full, _ = transformed_meta_model(cfg)
    layers = pf.scratch_layers()
    if layers is None:
        scratch = full
    else:
        scratch, _ = transformed_meta_model(cfg, pf.spec.architecture.truncated(model_args(cfg.model), layers))
    one = checkpoint_bytes(scratch, trainable_only=pf.lora)
    # the reference run's HF export, or the base a LoRA run on a preset writes (adapters are small)
    exported = export_bytes(scratch) if not pf.lora or pf.model_dir is None else 0
    run_dir = Path(cfg.logging.run_dir)
    outputs = [(Path(cfg.checkpoint.dir), checkpoint_bytes(full, trainable_only=pf.lora), "one checkpoint")] \
        if planned_saves(cfg, cfg.train.max_steps) else []
    if cfg.checkpoint.export_hf and not pf.lora:
        outputs.append((run_dir / "hf", export_bytes(full), "the HF export"))
    plans = {"working copy": ([(pf.work, NUM_SCRATCH_CHECKPOINTS * one + exported,
                                f"{NUM_SCRATCH_CHECKPOINTS} scratch checkpoints and an export")], 0),
             "outputs": (outputs, cfg.checkpoint.keep_last)}
    for label, (needs, keep_last) in plans.items():
        if not needs:  # no checkpoint and no export planned
            continue
        free = _free(needs[0][0])
        evidence[label] = {"needs": [{"path": str(d), "bytes": n, "what": w} for d, n, w in needs],
                           "free_bytes": free, "free": human_bytes(free)}
        try:
            evidence[label]["warnings"] = check_free_space(needs, keep_last)
        except ValueError as exc:
            problems.append(f"{label}: {exc}")
    return problems, evidence


def check_shards(pf: Preflight, hash_shards: bool = True) -> CheckResult:
    problems, evidence = [], {}
    if pf.model_dir is None:
        summary = (f"preset {pf.cfg.model.name_or_path}: no shards (its weights are built from seed "
                   f"{pf.cfg.train.seed})")
    else:
        try:
            report = verify_checkpoint(pf.model_dir, pf.spec.hf_format)
        except FileNotFoundError as exc:
            return CheckResult(2, "fail", str(exc), {"path": str(pf.model_dir)})
        evidence["verify"] = report.to_dict()
        problems += [str(p) for p in report.problems]
        hashed, evidence["sha256"] = hash_problems(pf.model_dir, hash_shards)
        problems += hashed
        verified = sum(isinstance(v, dict) for v in evidence["sha256"].values())
        hashes = (f"sha256 verified for {verified} of {report.num_files}"
                  + ("" if verified == report.num_files else
                     " (the others have no hash recorded by the download: their bytes are not verified)")
                  if hash_shards else "bytes after the headers not verified (--no-shard-hashes)")
        summary = (f"{report.num_files} shards, {report.num_tensors:,} tensors, {human_bytes(report.num_bytes)} "
                   f"(headers, sizes, shapes, dtypes); {hashes}")
    space, evidence["disk"] = space_problems(pf)
    problems += space
    disk = "; ".join(f"{label}: {human_bytes(sum(n['bytes'] for n in e['needs']))} of {e['free']} free"
                     for label, e in evidence["disk"].items())
    evidence["disk"]["source"] = ({"path": str(pf.model_dir), "bytes": evidence["verify"]["num_bytes"],
                                   "note": "on disk already (verified above)"} if pf.model_dir is not None
                                  else {"note": "a preset: nothing to store"})
    return verdict(2, problems, f"{summary}; {disk}", evidence)
