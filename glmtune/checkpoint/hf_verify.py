"""Verify an HF GLM-5 checkpoint directory without reading any tensor data.

Only `config.json`, the safetensors index and each shard's header are read (a
safetensors file is: 8-byte little-endian header length, a JSON header mapping
key -> {dtype, shape, data_offsets}, then the raw data), so a 1.5 TB checkpoint
verifies in seconds. Checked:

  * config.json loads (`Glm5Args.from_hf_config`);
  * every shard the index names lies inside the directory (shard_paths.py; a name that
    leaves it is reported, never opened), exists, and its header parses;
  * index and headers agree key by key, in both directions;
  * each file's size equals the header's data end (catches truncated copies) and
    each tensor's byte range matches its dtype and shape;
  * every tensor the config implies is present with the expected shape (derived
    from the meta-device model through `Glm5StateDictAdapter.hf_shapes`), and no
    other tensors are;
  * dtypes: BF16/F32/F16, or F8_E4M3 with a `<key>_scale_inv` of shape
    ceil(out/128) x ceil(in/128); `e_score_correction_bias` must be F32.

All problems are collected (each naming its file and key) instead of stopping at
the first one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmtune.checkpoint.hf_io import INDEX_NAME, SINGLE_NAME
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.checkpoint.shard_paths import outside_reason, view_source
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.state_dict_adapter import FP8_BLOCK, SCALE_SUFFIX, Glm5StateDictAdapter
from glmtune.io.text_limits import parse_json, printable

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
WEIGHT_DTYPES = {"BF16", "F32", "F16"}
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = {"F32", "BF16"}
# The router's selection bias is added to fp32 sigmoid scores; a lower precision
# copy changes which experts are picked.
F32_ONLY_SUFFIX = "e_score_correction_bias"


@dataclass(frozen=True)
class Problem:
    file: str  # file name relative to the checkpoint directory
    key: str | None  # tensor key, None for file-level problems
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.message}" if self.key else f"{self.file}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    args: Glm5Args | None = None  # None when config.json did not load
    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_tensors: int = 0  # every tensor in every readable header, scales included
    num_bytes: int = 0  # tensor data bytes
    num_params: int = 0  # elements of the model tensors (scales excluded)
    num_expected: int = 0  # tensors the config implies

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, file: str, key: str | None, message: str) -> None:
        self.problems.append(Problem(file, key, message))

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "ok": self.ok, "num_files": self.num_files, "num_tensors": self.num_tensors,
            "num_bytes": self.num_bytes, "num_params": self.num_params, "num_expected": self.num_expected,
            "problems": [{"file": p.file, "key": p.key, "message": p.message} for p in self.problems],
        }


def expected_hf_shapes(args: Glm5Args) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every tensor a checkpoint of `args` holds (MTP layers included)."""
    state = build_model(args, device="meta").state_dict()
    if args.tie_word_embeddings:
        state.pop("lm_head.weight")  # transformers writes only the embedding
    return Glm5StateDictAdapter(args).hf_shapes({k: tuple(v.shape) for k, v in state.items()})


def _index(path: Path, report: VerifyReport) -> tuple[dict[str, str], Path | None] | None:
    """(key -> shard name from the index, the checkpoint a truncated view links to or None);
    ({}, None) for a single-file checkpoint; None if neither."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            parsed = parse_json(index.read_bytes(), INDEX_NAME, max_bytes=256 << 20)
            weight_map = parsed["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            odd = next((key for key, name in weight_map.items() if not isinstance(name, str)), None)
            if odd is not None:
                raise TypeError(f"the entry for {printable(repr(odd))[:120]} is not a file name")
        except (ValueError, KeyError, TypeError) as exc:
            report.add(INDEX_NAME, None, f"not a safetensors index ({exc})")
            return None
        return dict(weight_map), view_source(parsed)
    if (path / SINGLE_NAME).is_file():
        return {}, None
    report.add(str(path), None, f"no {INDEX_NAME} or {SINGLE_NAME}")
    return None


def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES:
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets))


def _check_entries(name: str, header: dict[str, Any], data_start: int, size: int, report: VerifyReport) -> None:
    """Per-tensor byte ranges and the file size against the header's data end."""
    data_end = 0
    for key, entry in header.items():
        if not _valid_entry(entry):
            if isinstance(entry, dict) and entry.get("dtype") not in DTYPE_BYTES:
                report.add(name, key, f"unknown dtype {entry.get('dtype')!r}")
            else:
                report.add(name, key, f"malformed header entry {entry!r}")
            continue
        (start, end), dtype, shape = entry["data_offsets"], entry["dtype"], entry["shape"]
        data_end = max(data_end, end)
        if end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
            report.add(name, key, f"data range {start}..{end} does not hold {dtype} {tuple(shape)}")
    expected = data_start + data_end
    if size < expected:
        report.add(name, None, f"truncated: {size} bytes, the header needs {expected}")
    elif size > expected:
        report.add(name, None, f"{size - expected} trailing bytes after the data the header describes")


def _check_tensor(name: str, key: str, entry: dict[str, Any], shape: tuple[int, ...],
                  headers: dict[str, tuple[str, dict]], report: VerifyReport) -> None:
    """Shape and dtype of one expected tensor (and its FP8 scale)."""
    dtype, actual = entry["dtype"], tuple(entry["shape"])
    if actual != shape:
        report.add(name, key, f"shape {actual}, expected {shape}")
    if key.endswith(F32_ONLY_SUFFIX):
        if dtype != "F32":
            report.add(name, key, f"dtype {dtype}, expected F32")
        return
    if dtype in WEIGHT_DTYPES:
        return
    if dtype != FP8_DTYPE:
        report.add(name, key, f"dtype {dtype}, expected one of {sorted(WEIGHT_DTYPES)} or {FP8_DTYPE}")
        return
    scale_key = key + SCALE_SUFFIX
    if len(shape) != 2:
        report.add(name, key, f"{FP8_DTYPE} tensor of shape {shape}: only 2-D weights are block-quantized")
        return
    if scale_key not in headers:
        report.add(name, key, f"{FP8_DTYPE} tensor without {scale_key}")
        return
    scale_file, scale_entry = headers[scale_key]
    if not _valid_entry(scale_entry):
        return  # reported as malformed already
    block_shape = tuple(-(-dim // FP8_BLOCK) for dim in shape)
    if tuple(scale_entry["shape"]) != block_shape:
        report.add(scale_file, scale_key, f"shape {tuple(scale_entry['shape'])}, expected {block_shape} "
                                          f"({FP8_BLOCK}x{FP8_BLOCK} blocks of {shape})")
    if scale_entry["dtype"] not in SCALE_DTYPES:
        report.add(scale_file, scale_key, f"dtype {scale_entry['dtype']}, expected one of {sorted(SCALE_DTYPES)}")


def verify_checkpoint(path: str | Path) -> VerifyReport:
    """Check a checkpoint directory's structure, shapes and dtypes from headers only.

    Args:
        path: an HF checkpoint directory (config.json plus model.safetensors or a
            sharded `model.safetensors.index.json`).

    Returns:
        A report; `report.ok` is False when any problem was found.

    Raises:
        FileNotFoundError: `path` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint directory")
    report = VerifyReport(str(path))
    try:
        report.args = Glm5Args.from_hf_config(path)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        report.add("config.json", None, f"does not load: {exc}")

    indexed = _index(path, report)
    if indexed is None:
        return report
    weight_map, source = indexed
    sharded = bool(weight_map)
    files = sorted(set(weight_map.values())) if sharded else [SINGLE_NAME]
    report.num_files = len(files)
    headers = _read_headers(path, files, weight_map, source, report)
    if not sharded:
        weight_map = {key: SINGLE_NAME for key in headers}
    if report.args is not None:  # without a config there is nothing to compare the tensors to
        _check_against_model(report.args, headers, weight_map, INDEX_NAME if sharded else SINGLE_NAME, report)
    return report


def _read_headers(path: Path, files: list[str], weight_map: dict[str, str], source: Path | None,
                  report: VerifyReport) -> dict[str, tuple[str, dict]]:
    """key -> (file, header entry) over all readable shards; index/header mismatches reported."""
    headers: dict[str, tuple[str, dict]] = {}
    readable: set[str] = set()
    for name in files:
        outside = outside_reason(path, name, source)
        if outside:  # never opened: the index may name any file on the machine
            report.add(INDEX_NAME if weight_map else name, None,
                       f"names {printable(repr(name))[:120]}, which {outside}" if weight_map else outside)
            continue
        file = path / name
        if not file.is_file():
            num_keys = sum(1 for v in weight_map.values() if v == name)
            report.add(name, None, f"missing (named in {INDEX_NAME} for {num_keys} tensors)")
            continue
        try:
            header, data_start = read_header(file)
        except ValueError as exc:
            report.add(name, None, str(exc))
            continue
        readable.add(name)
        _check_entries(name, header, data_start, file.stat().st_size, report)
        for key, entry in header.items():
            report.num_tensors += 1
            if _valid_entry(entry):
                report.num_bytes += entry["data_offsets"][1] - entry["data_offsets"][0]
            if key in headers:
                report.add(name, key, f"also stored in {headers[key][0]}")
                continue
            headers[key] = (name, entry)
            if weight_map and key not in weight_map:
                report.add(name, key, f"in the file but not in {INDEX_NAME}")
            elif weight_map and weight_map[key] != name:
                report.add(name, key, f"in the file but {INDEX_NAME} places it in {weight_map[key]}")
    for key, name in sorted(weight_map.items()):
        if name in readable and headers.get(key, ("",))[0] != name:
            report.add(name, key, f"listed in {INDEX_NAME} but not in the file")
    return headers


def _check_against_model(args: Glm5Args, headers: dict[str, tuple[str, dict]], weight_map: dict[str, str],
                         listing: str, report: VerifyReport) -> None:
    """Every expected tensor present with its shape and dtype; nothing unexpected.

    `listing` is the file a missing key is reported against (the index, or the
    single safetensors file).
    """
    expected = expected_hf_shapes(args)
    report.num_expected = len(expected)
    for key, shape in expected.items():
        if key in headers:
            name, entry = headers[key]
            if _valid_entry(entry):
                _check_tensor(name, key, entry, shape, headers, report)
                report.num_params += math.prod(entry["shape"])
        elif key not in weight_map:  # listed keys absent from their file were reported above
            report.add(listing, key, "missing")
    for key, (name, entry) in headers.items():
        if key in expected:
            continue
        base = key[: -len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else None
        base_entry = headers[base][1] if base in headers else None
        if base in expected and isinstance(base_entry, dict) and base_entry.get("dtype") == FP8_DTYPE:
            continue  # the scale of an FP8 weight, checked with its weight
        hint = " (tie_word_embeddings: lm_head shares the embedding)" if key == "lm_head.weight" else ""
        report.add(name, key, f"unexpected tensor (not part of this config's model){hint}")


def format_report(report: VerifyReport) -> list[str]:
    """Human-readable lines: one per problem, then a summary."""
    lines = [str(p) for p in report.problems]
    verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    lines.append(f"{report.path}: {verdict}; {report.num_files} file(s), {report.num_tensors} tensors, "
                 f"{report.num_bytes:,} bytes, {report.num_params:,} params checked")
    return lines
