"""The reference model of a full fine-tuning preference run: its log-probabilities, computed once.

DPO compares the policy with the model it started from. With LoRA that model is the policy with
its adapters off; a full fine-tune changes every weight, and holding a second copy of GLM-5 is out
of the question. So before the first step the starting weights score every packed row once (a
no_grad forward per micro-batch), and each row keeps the reference log-probability of each of
its supervised targets (`row["ref_token_logps"]`, [supervised targets of the row], fp32; `collate`
scatters it back to [B, T] beside `targets`).

The values are cached beside the tokenized data (`<data.cache_dir>/reference_logps/<key>.safetensors`,
written atomically, read without unpickling). The key hashes what the numbers depend on: the
starting model (an HF directory's config and its weight files' names, sizes and modification
times — not their bytes, which for GLM-5 would take an hour to hash; a preset's base weights'
hash), the compute dtype and kernel backends, and the packed rows themselves. A resumed run, or a
second run on the same data and model, reads them instead of computing again; a file whose
shapes do not match the rows is refused, never used.

The rows are split over the data-parallel ranks (row i on rank i mod dp); each rank scores its
rows (every rank runs the same number of forwards: FSDP2 and EP gather inside them), and one
all-reduce of the flat values over the data-parallel group gives every rank all of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from glmtune.data.packing import next_token_targets
from glmtune.data.token_cache import default_cache_dir
from glmtune.train.data_loader import collate

CACHE_VERSION = 1
FIELD = "ref_token_logps"


def rows_sha256(rows: list[dict[str, Any]]) -> str:
    """sha256 of the packed rows' token fields (what the reference scores)."""
    digest = hashlib.sha256()
    for field in ("input_ids", "labels", "position_ids", "document_ids"):
        digest.update(field.encode())
        for row in rows:
            digest.update(np.asarray(row[field], dtype=np.int64).tobytes())
    return digest.hexdigest()


def model_files_identity(model_dir: Path) -> dict[str, Any]:
    """An HF directory's config and its weight files' names, sizes and mtimes (module docstring)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    return {"path": str(model_dir.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def cache_key(starting_model: dict[str, Any], compute: dict[str, Any], train_rows, val_rows) -> str:
    blob = json.dumps({"version": CACHE_VERSION, "model": starting_model, "compute": compute,
                       "train": rows_sha256(train_rows), "validation": rows_sha256(val_rows)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(cache_dir: str | None, key: str) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "reference_logps" / f"{key}.safetensors"


def _supervised_counts(rows: list[dict[str, Any]]) -> list[int]:
    return [sum(t != -100 for t in next_token_targets(row["labels"])) for row in rows]


def _score_rows(model, token_logps, rows, micro_batch: int, device, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows (i mod world == rank) scored in micro-batches: each one's supervised targets'
    log-probabilities. Every rank runs the same number of forwards (a short rank repeats a batch)."""
    mine = list(range(rank, len(rows), world))
    steps = math.ceil(math.ceil(len(rows) / world) / micro_batch)
    scored: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for step in range(steps):
            indices = mine[step * micro_batch:(step + 1) * micro_batch] or mine[:micro_batch] or [0]
            batch = collate([rows[i] for i in indices])
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            logps_BS = token_logps(model, batch).float()
            for b, i in enumerate(indices):
                if i in mine:
                    scored[i] = logps_BS[b][batch["targets"][b] != -100].cpu()
    return [scored.get(i) for i in range(len(rows))]


def compute(model, token_logps, rows, micro_batch: int, device, group=None) -> list[torch.Tensor]:
    """Every row's reference log-probabilities on every rank of `group` (module docstring)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    was_training = model.training
    model.eval()
    mine = _score_rows(model, token_logps, rows, micro_batch, device, rank, world)
    model.train(was_training)
    counts = _supervised_counts(rows)
    flat = torch.zeros(sum(counts), dtype=torch.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    for i, values in enumerate(mine):
        if values is not None:
            flat[offsets[i]:offsets[i + 1]] = values
    if distributed and world > 1:  # disjoint rows: the sum is every rank's values
        flat_dev = flat.to(device)
        dist.all_reduce(flat_dev, group=group)
        flat = flat_dev.cpu()
    return [flat[offsets[i]:offsets[i + 1]].clone() for i in range(len(rows))]


def save(path: Path, train: list[torch.Tensor], val: list[torch.Tensor], meta: dict[str, Any]) -> None:
    """Atomically: the flat values of each split and their per-row counts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for split, values in (("train", train), ("validation", val)):
        tensors[f"{split}.values"] = torch.cat(values) if values else torch.zeros(0)
        tensors[f"{split}.counts"] = torch.tensor([len(v) for v in values], dtype=torch.int64)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    os.close(fd)
    save_file(tensors, tmp, metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)


def load(path: Path, train_rows, val_rows) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The cached values, checked against the rows' supervised counts (a mismatch is refused)."""
    tensors = load_file(path)
    out = []
    for split, rows in (("train", train_rows), ("validation", val_rows)):
        counts = tensors[f"{split}.counts"].tolist()
        if counts != _supervised_counts(rows):
            raise ValueError(f"{path}: the cached reference log-probabilities do not match this run's {split} rows "
                             "(a damaged or foreign file); delete it to compute them again")
        out.append(list(torch.split(tensors[f"{split}.values"], counts)) if counts else [])
    return out[0], out[1]


def attach(rows: list[dict[str, Any]], values: list[torch.Tensor]) -> None:
    for row, row_values in zip(rows, values):
        row[FIELD] = row_values
