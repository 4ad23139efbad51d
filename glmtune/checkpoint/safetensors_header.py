"""A safetensors file's header, read without its tensor data.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping
key -> {dtype, shape, data_offsets} (plus an optional `__metadata__`), then the raw data.
`read_header` reads the first two and bounds them: what loading (hf_io), verifying
(hf_verify), fingerprinting and releasing a checkpoint learn from its shards without
reading a tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmtune.io.text_limits import parse_json

# safetensors refuses headers above 100 MB; a larger length means a corrupt file.
MAX_HEADER_BYTES = 100_000_000


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries without `__metadata__`, byte offset where the data starts).

    Raises:
        ValueError: the header is missing, too long for the file, or not JSON.
    """
    size = file.stat().st_size
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise ValueError(f"truncated safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"header length {header_len} exceeds the file ({size} bytes): truncated or corrupt")
        try:
            header = parse_json(fh.read(header_len), "safetensors header")
        except ValueError as exc:
            raise ValueError(f"corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + header_len

