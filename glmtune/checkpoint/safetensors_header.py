"""A safetensors file's header, read without its tensor data, as strictly as safetensors reads it.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping
key -> {dtype, shape, data_offsets} (plus an optional `__metadata__`), then the raw data.
`read_header` reads the first two: what loading (hf_io), verifying (hf_verify),
fingerprinting and releasing a checkpoint learn from its shards without reading a tensor.

It refuses whatever the safetensors library refuses when it opens the file (safetensors
0.8's `Metadata::validate` and `read_metadata`), so no reader here trusts a header that
loading (glmtune eval, transformers, vLLM) would reject, and no figure taken from one
(bytes, parameters) is larger than the file:

  * a header length beyond the file or over 100,000,000 bytes (the library's bound); bytes
    that are not UTF-8; anything but one JSON object;
  * `__metadata__` other than an object of strings;
  * an entry without a known dtype, a shape of integers in [0, 2^64) and two data_offsets in
    [0, 2^64); a shape whose element or byte count overflows 64 bits;
  * byte ranges that overlap, leave a gap, or do not start at 0 (sorted by offset, each must
    begin where the previous ended), a range whose length is not its dtype x shape, and a
    file whose size is not the header plus the last range's end (cut short, or bytes after);
  * and, stricter than the library (which keeps one silently), a tensor named twice.

Each refusal is a ValueError that does not name the file (the callers do).
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
METADATA_KEY = "__metadata__"
# Bits per element of every dtype safetensors 0.8 reads (its `Dtype` enum); sub-byte types
# (F4, F6) must fill whole bytes.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_USIZE = 1 << 64  # shapes, offsets and sizes are u64 (usize) in the library


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries without `__metadata__`, byte offset where the data starts).

    Each entry is {"dtype": str in DTYPE_BITS, "shape": [int >= 0, ...], "data_offsets":
    [begin, end]}, its range exactly its dtype x shape, the ranges tiling the data to the end
    of the file (module docstring).

    Raises:
        ValueError: not a safetensors file, or one safetensors would refuse; the file is not
            named (callers do).
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
    header = _parsed(raw)
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"corrupt safetensors header: {METADATA_KEY} is not an object of strings "
                         "(safetensors refuses the file)")
    for key, entry in header.items():
        problem = _entry_problem(entry)
        if problem:
            raise ValueError(f"corrupt safetensors header: tensor {_shown(key)} {problem}")
    data_end = _tiled_end(header)
    expected = 8 + header_len + data_end
    if size < expected:
        raise ValueError(f"truncated safetensors file: {size:,} bytes, the header needs {expected:,} (cut short)")
    if size > expected:
        raise ValueError(f"corrupt safetensors file: {size - expected:,} trailing bytes after the data the header "
                         "describes")
    return header, 8 + header_len


def _shown(key: str) -> str:
    return repr(printable(key)[:120])


def _parsed(raw: bytes) -> dict[str, Any]:
    """The header's JSON object (UTF-8, bounded, each tensor named once)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"corrupt safetensors header (not UTF-8: {exc.reason} at byte {exc.start})") from None
    if not text.lstrip().startswith("{"):
        raise ValueError("corrupt safetensors header (not a JSON object): not a safetensors file, or a damaged one")
    try:
        header = parse_json(text, "safetensors header", bytes_per_container=_BYTES_PER_CONTAINER, unique_keys=True)
    except ValueError as exc:
        raise ValueError(f"corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt safetensors header (not a JSON object)")
    return header


def _is_usize(value: Any) -> bool:
    return type(value) is int and 0 <= value < _USIZE


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one header entry (None when nothing is): its form, and its byte range
    against its dtype and shape, with the library's overflow checks."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BITS:
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        return f"has dtype {printable(repr(dtype))[:40]}, not one safetensors reads" if dtype is not None \
            else "has no dtype"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        return "has no shape of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_usize(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return "has no data_offsets [begin, end]"
    elements = 1
    for dim in shape:  # left to right, as the library multiplies: an overflow is refused even before a 0
        elements *= dim
        if elements >= _USIZE:
            return f"has a shape of more than 2^64 elements {_dims(shape)}"
    bits = elements * DTYPE_BITS[entry["dtype"]]
    if bits % 8 or bits // 8 >= _USIZE:
        return f"has a shape {_dims(shape)} that fills no whole number of bytes as {entry['dtype']}"
    if offsets[1] - offsets[0] != bits // 8:
        return (f"has data_offsets {offsets} ({offsets[1] - offsets[0]:,} bytes), but {entry['dtype']} "
                f"{_dims(shape)} needs {bits // 8:,}")
    return None


def _dims(shape: list[int]) -> str:
    text = str(tuple(shape))
    return text if len(text) <= 80 else text[:77] + "...)"


def _tiled_end(header: dict[str, Any]) -> int:
    """Where the data ends, after checking that the ranges, sorted, tile [0, end) with no overlap
    and no gap (safetensors' "invalid offset for tensor")."""
    end = 0
    for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves bytes {end:,}..{begin:,} unused"
            raise ValueError(f"corrupt safetensors header: tensor {_shown(key)} has data_offsets {[begin, stop]}, "
                             f"which {what} (invalid offset: safetensors refuses the file)")
        end = stop
    return end
