"""The base model of a release: where it came from (revision) and exactly what it is (hashes).

The base is the model the run started from:
  * a built-in preset (`model.name_or_path: tiny`): its random initial weights exist only in
    RUN_DIR/base, which the run writes. A LoRA adapter is useless without it, so a LoRA
    release needs it; a full fine-tune ships RUN_DIR/hf alone, and without RUN_DIR/base (runs
    from before `train` wrote it) the release records the preset's name, seed and config hash,
    and says that no weights were kept.
  * an HF directory (`model.name_or_path: /models/GLM-5`): its revision is the one the
    download recorded (an HF cache snapshot's commit, huggingface-cli's
    `.cache/huggingface/download/*.metadata`, or a git checkout's HEAD; glmtune/io/revisions.py),
    or "local directory" when none is, in which case the hashes are the only pin.

Either way the directory is recorded as an artifact (every shard's size and sha256) and its
tensor identity (`config_sha256`, `weights_sha256`: the same as glmtune/checkpoint/fingerprint.py's,
which adapters, `glmtune merge` and the scorecard name bases by) is computed in the same
pass over the shards. A base whose identity differs from the one the run recorded when it
trained (run.json, the adapter's glmtune_adapter.json) is refused: the adapter would be
served on weights it was not trained on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from glmtune.checkpoint.fingerprint import config_sha256, identity_mismatch, weights_sha256
from glmtune.checkpoint.hf_io import INDEX_NAME, checkpoint_files
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.config import JobConfig
from glmtune.io.revisions import model_revision
from glmtune.models.registry import is_preset, model_args, spec_for
from glmtune.release.artifacts import TensorRange, read_json, record_artifact

BASE_DIR = "base"  # RUN_DIR/base, as glmtune/train/run.py writes it


def _tensor_ranges(hf_dir: Path) -> dict[str, list[TensorRange]]:
    """Relative shard path -> the byte ranges of the tensors the checkpoint's index assigns to it."""
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(hf_dir).items():
        by_file.setdefault(file, []).append(name)
    ranges = {}
    for file, names in by_file.items():
        try:
            entries, data_start = read_header(file)
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None
        except RecursionError:  # read_header's json.loads on a header nested thousands deep
            raise ValueError(f"{file}: corrupt safetensors header (JSON nested too deep)") from None
        missing = [n for n in names if n not in entries]
        if missing:
            raise ValueError(f"{file}: no tensor {missing[0]} (the index names it)")
        ranges[file.relative_to(hf_dir).as_posix()] = [
            TensorRange(n, data_start + entries[n]["data_offsets"][0], data_start + entries[n]["data_offsets"][1])
            for n in names]
    return ranges


def _check_json_files(hf_dir: Path) -> None:
    """The directory's JSON files that other modules parse (config, index, tokenizer config),
    parsed bounded first: one line naming the file instead of a RecursionError."""
    for name in ("config.json", INDEX_NAME, "tokenizer_config.json"):
        if os.path.lexists(hf_dir / name):  # a FIFO is refused here, before the readers below would wait on it
            read_json(hf_dir / name, str(hf_dir / name))


def record_hf_dir(name: str, hf_dir: Path, what: str, manifest_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(artifact entry, identity) of an HF checkpoint directory, every byte read once.

    The identity equals `glmtune.models.registry.hf_dir_identity(hf_dir)` minus its path.
    """
    _check_json_files(hf_dir)
    args = spec_for(hf_dir).architecture.args_from_hf(hf_dir)
    ranges = _tensor_ranges(hf_dir)
    artifact, tensor_shas = record_artifact(name, hf_dir, "dir", what, manifest_dir,
                                            tensors=lambda rel: ranges.get(rel, []))
    entries = {}
    for rel, shas in tensor_shas.items():
        header, _ = read_header(hf_dir / rel)
        for tensor, sha in shas.items():
            entries[tensor] = (header[tensor]["dtype"], header[tensor]["shape"], sha)
    identity = {"config_sha256": config_sha256(args), "weights_sha256": weights_sha256(entries),
                "num_tensors": len(entries)}
    return artifact, identity


def _recorded_identities(run_dir: Path, run_record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, identity) of every record of the base the run trained on."""
    found = []
    if isinstance(run_record.get("base"), dict):
        found.append((str(run_dir / "run.json"), run_record["base"]))
    for layout_dir in ("adapter", "adapter_per_expert"):
        meta = run_dir / layout_dir / "glmtune_adapter.json"
        if meta.is_file():
            record, _ = read_json(meta, str(meta))
            base = record.get("base") if isinstance(record, dict) else None
            if isinstance(base, dict):
                found.append((str(meta), base))
    return found


def record_base(cfg: JobConfig, run_dir: Path, run_record: dict[str, Any], manifest_dir: Path,
                lora: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the manifest's `base` section, the base's artifact entry or None). See the module docstring."""
    name = cfg.model.name_or_path
    section: dict[str, Any] = {"name_or_path": name, "preset": None, "path": None, "revision": None}
    if is_preset(name):
        hf_dir = run_dir / BASE_DIR
        section.update(preset=name, seed=cfg.train.seed, overrides=cfg.model.overrides,
                       revision_source=f"local directory: preset {name}'s initial weights (seed {cfg.train.seed}), "
                                       "written by glmtune train")
        if not hf_dir.is_dir():
            if lora:
                raise ValueError(f"{run_dir} has no {BASE_DIR}/: a LoRA run on preset {name} keeps its base "
                                 "there and the adapter is useless without it")

            section.update(config_sha256=config_sha256(model_args(cfg.model)), weights_sha256=None,
                           num_tensors=None, artifact=None,
                           revision_source=f"preset {name} (seed {cfg.train.seed}); the run kept no copy of its "
                                           f"initial weights ({run_dir / BASE_DIR} does not exist)")
            return section, None
    else:
        hf_dir = Path(name)
        if not hf_dir.is_dir():
            raise ValueError(f"{run_dir / 'config.yaml'}: model.name_or_path {name} is not a directory "
                             "(moved or deleted?): the base model must be present to be recorded")
        revision, source = model_revision(hf_dir)
        section.update(revision=revision, revision_source=source if revision else
                       "local directory (no HF cache snapshot, .cache/huggingface metadata or git checkout): "
                       "the config and weight hashes are the pin")
    artifact, identity = record_hf_dir("base", hf_dir, f"base model ({name})", manifest_dir)
    for where, recorded in _recorded_identities(run_dir, run_record):
        reasons = identity_mismatch(recorded, identity)
        if reasons:
            raise ValueError(f"base model {hf_dir} is not the base the run trained on ({where}): "
                             f"{'; '.join(reasons)}")
    section.update(path=artifact["root"], **identity, artifact="base")
    return section, artifact
