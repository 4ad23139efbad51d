"""What parsing a safetensors header may build (issue 44, re-test): a `__metadata__` of
`[{},{},...]` (95 MB of it took `inspect --verify` 2.8 GB and 8.6 s, then "OK") is refused before
the parse, in one line, while a header shaped as a GLM-5 shard's (long names, FP8 weights and
their scales) far beyond the fixed allowance still reads."""

from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glmtune.checkpoint.safetensors_header import read_header


def _raw_file(path: Path, header: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return path


def test_a_metadata_bomb_is_refused_before_it_is_built(tmp_path):
    header = (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":['
              + b"{}," * 400_000 + b"{}]}")  # 1.2 MB, 400,006 containers
    path = _raw_file(tmp_path / "bomb.safetensors", header)
    tracemalloc.start()
    began = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=r"^corrupt safetensors header \(safetensors header: 400,006 JSON arrays "
                                             r"and objects in 1,200,074 bytes, more than the 75,004 allowed"):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(header), peak  # parsed (with json_depth's walk): ~60 MB
    assert time.perf_counter() - began < 5.0  # tracemalloc's slowness included; parsed: seconds more


def test_a_glm5_shaped_shard_header_reads(tmp_path):
    tensors = {}
    for layer in range(3, 78):  # 75 layers x 64 experts x (weight, scale) x 3: 28,800 entries, 86,400 containers
        for expert in range(64):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[f"{name}.weight"] = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
                tensors[f"{name}.weight_scale_inv"] = torch.zeros(1, 1)
    path = tmp_path / "model-00001-of-00002.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    header, start = read_header(path)
    assert len(header) == len(tensors) == 28_800
    assert start - 8 > 65_536 * 16  # past the fixed allowance (MIN_CONTAINERS): the per-byte budget let it through
