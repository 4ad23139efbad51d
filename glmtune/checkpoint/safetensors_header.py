"""A safetensors file's header, read without its tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping
key -> {dtype, shape, data_offsets} (plus an optional `__metadata__`), then the raw data.
`read_header` reads the first two and bounds them: what loading (hf_io), verifying
(hf_verify), fingerprinting and releasing a checkpoint learn from its shards without
reading a tensor. A file that is not safetensors is said to be one in those words (its
first 8 bytes read as a length would be a meaningless number), and every entry of the
header is type-checked, so no reader of the entries meets a surprise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.io.text_limits import parse_json, printable

# safetensors refuses headers above 100 MB; a larger length means a corrupt file.
MAX_HEADER_BYTES = 100_000_000
# An entry holds three containers (itself, its shape, its data_offsets) in 50 bytes at the least
# and ~120 in a GLM-5 shard ("model.layers.77.mlp.experts.255.down_proj.weight"); one per 16
# bytes bounds what the parse builds (a 95 MB `__metadata__` of `[{},{},...]` took 2.8 GB).
_BYTES_PER_CONTAINER = 16


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries without `__metadata__`, byte offset where the data starts).

    Each entry is {"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]} with
    0 <= begin <= end (what the dtype and shape need of the range is the callers' check).

    Raises:
        ValueError: not a safetensors file (a header length beyond the file, no JSON object
            after it), or a header entry of the wrong form; the file is not named (callers do).
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise ValueError(f"not a safetensors file ({size} bytes, too short for a header)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"not a safetensors file (its first 8 bytes are no header length within its {size:,} "
                             "bytes: another kind of file, or one cut short in its header)")
        raw = fh.read(header_len)
    if not raw.lstrip().startswith(b"{"):
        raise ValueError("corrupt safetensors header (not a JSON object): not a safetensors file, or a damaged one")
    try:
        header = parse_json(raw, "safetensors header", bytes_per_container=_BYTES_PER_CONTAINER)
    except ValueError as exc:
        raise ValueError(f"corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        problem = _entry_problem(entry)
        if problem:
            raise ValueError(f"corrupt safetensors header: tensor {printable(key)[:120]!r} {problem}")
    return header, 8 + header_len


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one header entry's form (None when nothing is)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return "has no dtype"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return "has no shape of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return "has no data_offsets [begin, end]"
    return None
