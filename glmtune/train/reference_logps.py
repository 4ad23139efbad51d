"""The reference model of a full fine-tuning preference run: its log-probabilities, computed once.

DPO compares the policy with the model it started from. With LoRA that model is the policy with
its adapters off; a full fine-tune changes every weight, and holding a second copy of GLM-5 is out
of the question. So before the first step the starting weights score every packed row once (a
no_grad forward per micro-batch), and each row keeps the reference log-probability of each of
its supervised targets (`row["ref_token_logps"]`, [supervised targets of the row], fp32; `collate`
scatters it back to [B, T] beside `targets`).

The values are cached beside the tokenized data (`<data.cache_dir>/reference_logps/<key>.safetensors`,
written atomically, read without unpickling). The key hashes what the numbers depend on: the
starting model, the compute dtype and kernel backends, and the packed rows themselves. An HF
directory's identity is its config and its weight files' names, sizes, modification times,
inodes and status-change times (ctime), and a sample of their content: each safetensors file's
header and `SAMPLE_BYTES` from the start and the middle of every tensor (`content_sample`), a
few reads per tensor where hashing every byte of GLM-5 would take an hour. The modification
time can be put back (`cp -p`, `touch -r`, `os.utime`) and the sample misses a rewrite between
its reads; the ctime cannot be set, and every write, in place or by a file renamed over the old
one, moves it (a new inode too). So any change to a weight file changes the key and the
reference is computed again; so does a mere `chmod` (a recomputation, never a stale reuse). A preset's identity is its base weights' full hash. A resumed run,
or a second run on the same data and model, reads the values instead of computing them again
(the log names the file, whose name is the key); a cache file that is not what `save` writes,
or whose shapes do not match the rows, is refused in one sentence naming it, never used.

The rows are split over the data-parallel ranks (row i on rank i mod dp); each rank scores its
rows (every rank runs the same number of forwards: FSDP2 and EP gather inside them), and one
all-reduce of the flat values over the data-parallel group gives every rank all of them.
The model family's step runner scores them (`StepRunner.token_logps`, whole rows). Context
parallelism: the cp ranks of one dp index score the same rows, each forward giving its slice of
each row's queries, gathered into whole rows with the model's sequence shard; they hold the same
values, so nothing is reduced over cp. Pipeline parallelism: the rows go through the pipeline,
forward only; only the last stage's rank has their values, so one all-reduce over the runner's
`scores_group` (the pp ranks; zeros elsewhere) comes before the one over dp.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from glmtune.checkpoint.safetensors_header import read_header
from glmtune.data.packing import next_token_targets
from glmtune.data.token_cache import default_cache_dir
from glmtune.distributed.fsdp_state import release_gathered
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import StepRunner
from glmtune.train.data_loader import REFERENCE_CACHE, collate

CACHE_VERSION = 3  # 2: an HF directory's identity samples its weights' content; 3: their inodes and ctimes
SAMPLE_BYTES = 64  # per tensor, at its start and in its middle


def rows_sha256(rows: list[dict[str, Any]]) -> str:
    """sha256 of the packed rows' token fields (what the reference scores)."""
    digest = hashlib.sha256()
    for field in ("input_ids", "labels", "position_ids", "document_ids"):
        digest.update(field.encode())
        for row in rows:
            digest.update(np.asarray(row[field], dtype=np.int64).tobytes())
    return digest.hexdigest()


def content_sample(file: Path) -> str:
    """sha256 of a safetensors file's header and of `SAMPLE_BYTES` at the start and in the middle
    of each of its tensors (module docstring). ValueError naming the file when it is not safetensors."""
    try:
        entries, data_start = read_header(file)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
    digest = hashlib.sha256()
    fd = os.open(file, os.O_RDONLY)
    try:
        digest.update(os.pread(fd, data_start, 0))
        for entry in sorted(entries.values(), key=lambda e: e["data_offsets"]):
            begin, end = (data_start + offset for offset in entry["data_offsets"])
            for at in sorted({begin, max(begin, (begin + end - SAMPLE_BYTES) // 2)}):
                digest.update(os.pread(fd, min(SAMPLE_BYTES, end - at), at))
    finally:
        os.close(fd)
    return digest.hexdigest()


def model_files_identity(model_dir: Path) -> dict[str, Any]:
    """An HF directory's config and its weight files' names, sizes, mtimes, inodes, ctimes and
    sampled content (module docstring); the files sampled in parallel (reads release the GIL)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    weights = [p for p in files if p.suffix == ".safetensors"]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        samples = dict(zip((p.name for p in weights), pool.map(content_sample, weights)))
    stats = {p.name: p.stat() for p in files}
    return {"path": str(model_dir.resolve()),
            "files": [[name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns] for name, st in stats.items()],
            "content": samples}


def cache_key(starting_model: dict[str, Any], compute: dict[str, Any], train_rows, val_rows) -> str:
    blob = json.dumps({"version": CACHE_VERSION, "model": starting_model, "compute": compute,
                       "train": rows_sha256(train_rows), "validation": rows_sha256(val_rows)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path(cache_dir: str | None, key: str) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "reference_logps" / f"{key}.safetensors"


def _supervised_counts(rows: list[dict[str, Any]]) -> list[int]:
    return [sum(t != -100 for t in next_token_targets(row["labels"])) for row in rows]


def _score_rows(runner: StepRunner, rows, micro_batch: int, rank: int, world: int) -> list[torch.Tensor | None]:
    """This rank's rows (i mod world == rank) scored in micro-batches: each one's supervised targets'
    log-probabilities (None for rows not scored here, and everywhere on a pp rank without the last
    stage). Every rank runs the same forwards: the same number of micro-batches (a short rank
    repeats a batch), cp ranks of one dp index the same rows."""
    mine = list(range(rank, len(rows), world))
    steps = math.ceil(math.ceil(len(rows) / world) / micro_batch)
    scored: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for step in range(steps):
            indices = mine[step * micro_batch:(step + 1) * micro_batch] or mine[:micro_batch] or [0]
            batch = collate([rows[i] for i in indices])
            logps_BT = runner.token_logps(MicroBatch.of_batch(batch, runner.local_tokens))
            if logps_BT is None:
                continue
            for b, i in enumerate(indices):
                if i in mine:
                    scored[i] = logps_BT[b].cpu()[batch["targets"][b] != -100]
    return [scored.get(i) for i in range(len(rows))]


def _all_reduce(flat: torch.Tensor, device, group) -> torch.Tensor:
    """The sum over `group` (on the device: NCCL reduces device tensors)."""
    flat_dev = flat.to(device)
    dist.all_reduce(flat_dev, group=group)
    return flat_dev.cpu()


def compute(runner: StepRunner, rows, micro_batch: int, group=None) -> list[torch.Tensor]:
    """Every row's reference log-probabilities on every rank of `group` (the data-parallel ranks),
    and on every rank of the runner's `scores_group` (a pipeline's ranks) too (module docstring).
    `runner`: the model family's step runner of the starting model."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    was_training = [root.training for root in runner.roots]
    for root in runner.roots:
        root.eval()
    mine = _score_rows(runner, rows, micro_batch, rank, world)
    for root, training in zip(runner.roots, was_training):
        root.train(training)
        # FSDP2 keeps a root unit's gathered weights after a forward: the optimizer, built next, must see the shards.
        release_gathered(root)
    counts = _supervised_counts(rows)
    flat = torch.zeros(sum(counts), dtype=torch.float32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    for i, values in enumerate(mine):
        if values is not None:
            flat[offsets[i]:offsets[i + 1]] = values
    if runner.scores_group is not None:  # the last stage's values, zeros on the other pp ranks
        flat = _all_reduce(flat, runner.device, runner.scores_group)
    if distributed and world > 1:  # disjoint rows: the sum is every rank's values
        flat = _all_reduce(flat, runner.device, group)
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


def _read_cache(path: Path) -> dict[str, torch.Tensor]:
    """The tensors `save` writes, each of its dtype and shape; ValueError naming the file otherwise."""
    try:
        entries, data_start = read_header(path)
        if path.stat().st_size < data_start + max((e["data_offsets"][1] for e in entries.values()), default=0):
            raise ValueError("truncated")
        tensors = load_file(path)
    except Exception as exc:  # read_header's ValueError; safetensors' own SafetensorError
        raise ValueError(f"{path}: not a reference log-probability cache (unreadable safetensors: {exc}); "
                         "delete it to compute them again") from None
    for split in ("train", "validation"):
        values, counts = tensors.get(f"{split}.values"), tensors.get(f"{split}.counts")
        if not (isinstance(values, torch.Tensor) and values.dtype == torch.float32 and values.dim() == 1
                and isinstance(counts, torch.Tensor) and counts.dtype == torch.int64 and counts.dim() == 1
                and bool((counts >= 0).all()) and int(counts.sum()) == values.numel()):
            raise ValueError(f"{path}: not a reference log-probability cache ({split} values and counts are not "
                             "what glmtune writes); delete it to compute them again")
    return tensors


def load(path: Path, train_rows, val_rows) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The cached values, checked against the rows' supervised counts (a mismatch is refused)."""
    tensors = _read_cache(path)
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
        row[REFERENCE_CACHE] = row_values
