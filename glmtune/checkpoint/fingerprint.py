"""The content identity of a base model, so an adapter can name the exact base it was trained on.

    {"kind": "hf_dir", "path": "/models/glm5", "config_sha256": "...", "weights_sha256": "...",
     "num_tensors": 1809}

`weights_sha256` is one sha256 over a line per tensor, in sorted HF-name order:
`name dtype shape sha256(raw bytes)`, with dtype as safetensors spells it (BF16, F32,
F8_E4M3). It depends only on the tensors, not on how they are split into shard files
or on the file names. A LoRA run on a built-in preset writes the preset as an HF
directory (RUN_DIR/base) and records that directory's identity.

`config_sha256` is the sha256 of the canonical JSON (sorted keys) of the config as
the model's family reads it (its args' `to_hf_dict()`; the family's `read_args` is passed in,
`glmtune.models.registry.base_identity` passes the directory's), without the keys that describe how a file
was written or how the model is run rather than what it computes: `COSMETIC_KEYS`
(versions, the origin path, the dtype, which the weights digest already covers per
tensor, caching and router-logit switches, the quantization recipe, which the weights
digest covers as the stored tensors). A preset and its `save_pretrained` copy agree.

Hashing reads each tensor's bytes straight from the files in 8 MiB chunks (memory
stays bounded whatever the tensor size), tensors in a thread pool: hashlib and file
reads release the GIL.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from glmtune.checkpoint.hf_io import checkpoint_files
from glmtune.checkpoint.safetensors_header import read_header


COSMETIC_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache",
                 "output_router_logits", "quantization_config")
_CHUNK_BYTES = 8 << 20


def config_sha256(args) -> str:
    """sha256 of a family's args' model fields (`to_hf_dict()`, see module docstring)."""
    config = {k: v for k, v in args.to_hf_dict().items() if k not in COSMETIC_KEYS}
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_sha256(entries: dict[str, tuple[str, list[int], str]]) -> str:
    digest = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, tensor_sha = entries[name]
        digest.update(f"{name} {dtype} {list(shape)} {tensor_sha}\n".encode())
    return digest.hexdigest()


def _file_range_sha256(file: Path, start: int, end: int) -> str:
    digest = hashlib.sha256()
    fd = os.open(file, os.O_RDONLY)
    try:
        offset = start
        while offset < end:
            chunk = os.pread(fd, min(_CHUNK_BYTES, end - offset), offset)
            if not chunk:
                raise ValueError(f"{file}: truncated safetensors file (ends at byte {offset}, "
                                 f"the header needs {end})")
            digest.update(chunk)
            offset += len(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest()


def base_identity_from_dir(hf_dir: str | Path, read_args: Callable[[Path], Any],
                           num_threads: int | None = None) -> dict[str, Any]:
    """The identity of the HF checkpoint directory `hf_dir` (config.json + safetensors), its config
    read by its family's `read_args`.

    Raises:
        ValueError / FileNotFoundError: a missing or unreadable config, index or shard (named).
    """
    hf_dir = Path(hf_dir)
    args = read_args(hf_dir)
    files = checkpoint_files(hf_dir)
    headers = {}
    for file in sorted(set(files.values())):
        try:
            headers[file] = read_header(file)
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None
    jobs = {}
    for name, file in files.items():
        entries, data_start = headers[file]
        if name not in entries:
            raise ValueError(f"{file}: no tensor {name} (the index names it)")
        begin, end = entries[name]["data_offsets"]
        jobs[name] = (entries[name]["dtype"], entries[name]["shape"], file, data_start + begin, data_start + end)
    with ThreadPoolExecutor(num_threads or min(8, os.cpu_count() or 1)) as pool:
        shas = dict(zip(jobs, pool.map(lambda job: _file_range_sha256(*job[2:]), jobs.values())))
    entries = {name: (dtype, shape, shas[name]) for name, (dtype, shape, *_) in jobs.items()}
    return {"kind": "hf_dir", "path": str(hf_dir.resolve()), "config_sha256": config_sha256(args),
            "weights_sha256": weights_sha256(entries), "num_tensors": len(entries)}


def identity_mismatch(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Why `current` is not the base `recorded` names, one reason per differing hash ([] if it is)."""
    reasons = []
    for key, what in (("config_sha256", "config differs"), ("weights_sha256", "weights differ")):
        if recorded.get(key) and recorded[key] != current.get(key):
            reasons.append(f"{what}: recorded sha256 {recorded[key][:12]}…, found {str(current.get(key))[:12]}…")
    return reasons
