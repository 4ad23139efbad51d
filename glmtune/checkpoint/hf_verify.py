"""Verify an HF checkpoint directory without reading any tensor data; refuse one that cannot be
loaded before anything is allocated at the size its config.json claims.

Only `config.json`, the safetensors index and each shard's header are read (a
safetensors file is: 8-byte little-endian header length, a JSON header mapping
key -> {dtype, shape, data_offsets}, then the raw data), so a 1.5 TB checkpoint
verifies in seconds. Checked:

  * config.json loads (the family's `HfFormat.read_config`), and the model its sizes describe
    can be built on the meta device (no tensor of more bytes than a machine addresses);
  * no entry of the directory is a FIFO, a socket or a device (a reader would wait on it
    forever), each named for what it is;
  * every shard the index names lies inside the directory (shard_paths.py; a name that
    leaves it is reported, never opened), exists, and its header is one safetensors reads
    (safetensors_header.py: the library's own rules, so the byte and parameter figures below
    never exceed the files);
  * index and headers agree key by key, in both directions;
  * every tensor the config implies is present with the expected shape (derived
    from the meta-device model through the family's state-dict adapter's `to_hf`), and no
    other tensors are; a config implying more layers than the files hold tensors is said
    before the model is built, and the comparison stops once more tensors are expected than
    stored (a config of 10^9 experts is one problem, not 10^9);
  * dtypes: BF16/F32/F16, or F8_E4M3 with a `<key>_scale_inv` of shape
    ceil(out/128) x ceil(in/128) (checkpoint/fp8_layout.py); a tensor the adapter requires in
    one dtype (GLM-5's `e_score_correction_bias`: F32) in that one.

Knows no family: what it needs of one (config.json's reader, the adapter, the model on meta) is
the family's `HfFormat` (models/common/hf_format.py), which its spec hands over.

`verify_checkpoint` collects all problems (each naming its file and key), for `glmtune
inspect --verify`. `check_loadable` is the same check as a gate: every load of an HF
directory (hf_io.load_pretrained, sharded_load.load_sharded) raises its first problem as one
sentence before building the model; the model spec's `args_from_hf`, which train's launch
check, eval, plan, preflight, export and inspect read the architecture through, raises the
first that says the weights are another model than the config's (a missing or damaged file
is left to the load, and to preflight's own shard check).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glmtune.checkpoint.fp8_layout import FP8_BLOCK, SCALE_SUFFIX
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.checkpoint.shard_paths import outside_reason, view_source
from glmtune.io.regular import kind_of, open_regular
from glmtune.io.text_limits import parse_json, printable
from glmtune.models.common.hf_format import HfFormat, StateDictAdapter

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 256 << 20  # GLM-5's index is ~5 MB
WEIGHT_DTYPES = {"BF16", "F32", "F16"}
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = {"F32", "BF16"}
# Missing tensors listed past the number stored before the comparison stops.
_MISSING_LISTED = 100
# What a directory entry may not be: reading it would block or never end.
BLOCKING_KINDS = ("a FIFO (named pipe)", "a socket", "a character device", "a block device")


@dataclass(frozen=True)
class Problem:
    file: str  # file name relative to the checkpoint directory
    key: str | None  # tensor key, None for file-level problems
    message: str
    # True: the weights are not the model config.json describes (a shape, a dtype, a tensor
    # missing or unexpected, sizes past any machine); False: a file is missing or damaged.
    against_config: bool = False

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.message}" if self.key else f"{self.file}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    args: Any = None  # the family's args; None when config.json did not load
    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_tensors: int = 0  # every tensor in every readable header, scales included
    num_bytes: int = 0  # tensor data bytes of the readable headers (each within its file)
    num_params: int = 0  # elements of the model tensors (scales excluded)
    num_expected: int = 0  # tensors the config implies (as far as they were compared)
    files: list[Path] = field(default_factory=list, repr=False)  # index and shards read

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, file: str, key: str | None, message: str, against_config: bool = False) -> None:
        self.problems.append(Problem(file, key, message, against_config))

    def add_config(self, file: str, key: str | None, message: str) -> None:
        self.add(file, key, message, against_config=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "ok": self.ok, "num_files": self.num_files, "num_tensors": self.num_tensors,
            "num_bytes": self.num_bytes, "num_params": self.num_params, "num_expected": self.num_expected,
            "problems": [{"file": p.file, "key": p.key, "message": p.message} for p in self.problems],
        }


def _meta_model(fmt: HfFormat, args: Any):
    """The model of `args` on the meta device; ValueError when a size is past any machine
    (torch cannot even describe a tensor of more than 2^63 bytes)."""
    try:
        return fmt.build_meta(args, torch.float32)
    except (RuntimeError, TypeError, OverflowError) as exc:
        raise ValueError(f"its sizes describe a tensor no machine holds ({printable(str(exc))[:160]})") from None


def expected_items(fmt: HfFormat, args: Any, model=None, adapter: StateDictAdapter | None = None):
    """(HF key, shape) of every tensor a checkpoint of `args` holds (a family's extra layers, such
    as GLM-5's MTP layers, included; a tied head not), one at a time in model order: a stacked
    expert tensor is split as it is reached. `model`: `args`'s on meta, when built already."""
    state = (model if model is not None else _meta_model(fmt, args)).state_dict()
    adapter = adapter if adapter is not None else fmt.adapter(args)
    for key, tensor in state.items():
        if key not in adapter.tied_keys:  # transformers writes only the tensor it is tied to
            for hf_key, part in adapter.to_hf(key, tensor):
                yield hf_key, tuple(part.shape)


def expected_hf_shapes(fmt: HfFormat, args: Any) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every tensor a checkpoint of `args` holds."""
    return dict(expected_items(fmt, args))


def holds_weights(path: str | Path) -> bool:
    """`path` is a directory with a safetensors index or a single safetensors file (of any kind:
    a FIFO there is the verifier's to name)."""
    path = Path(path)
    return path.is_dir() and any(os.path.lexists(path / name) for name in (INDEX_NAME, SINGLE_NAME))


def read_index(index: Path) -> dict[str, Any]:
    """A safetensors index, bounded: {"weight_map": {key: name}, ...} (the names are the callers'
    to check: shard_paths.py); ValueError saying
    what is wrong (the file is not named: callers do), a FIFO or a device named for what it is."""
    try:
        fh = open_regular(index)
    except ValueError:
        raise ValueError(f"is {kind_of(index)}, not a regular file: a reader would wait on it forever") from None
    with fh:
        raw = fh.read(MAX_INDEX_BYTES + 1)
    try:
        parsed = parse_json(raw, "its JSON", max_bytes=MAX_INDEX_BYTES)
    except ValueError as exc:
        raise ValueError(f"not a safetensors index ({exc})") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError("not a safetensors index (no weight_map object)")
    return parsed


def _index(path: Path, report: VerifyReport) -> tuple[dict[str, str], Path | None] | None:
    """(key -> shard name from the index, the checkpoint a truncated view links to or None);
    ({}, None) for a single-file checkpoint; None if neither."""
    index = path / INDEX_NAME
    if os.path.lexists(index) and kind_of(index) != "a link to nothing":
        try:
            parsed = read_index(index)
        except (ValueError, OSError) as exc:
            report.add(INDEX_NAME, None, str(exc))
            return None
        odd = next((key for key, name in parsed["weight_map"].items() if not isinstance(name, str)), None)
        if odd is not None:
            report.add(INDEX_NAME, None, f"not a safetensors index (the entry for {printable(repr(odd))[:120]} is "
                                         "not a file name)")
            return None
        report.files.append(index)
        return dict(parsed["weight_map"]), view_source(parsed)
    if os.path.lexists(path / SINGLE_NAME):
        return {}, None
    report.add(str(path), None, f"no {INDEX_NAME} or {SINGLE_NAME}")
    return None


def _special_entries(path: Path, report: VerifyReport) -> None:
    """Each entry of the directory a reader would block on (FIFO, socket, device: a tokenizer
    file, say), named for what it is, unless its own reader reported it already."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        report.add(str(path), None, f"cannot be listed ({exc.strerror or exc})")
        return
    reported = {p.file for p in report.problems}
    for name in names:
        kind = kind_of(path / name)
        if kind in BLOCKING_KINDS and printable(name) not in reported:
            report.add(printable(name), None, f"is {kind}, not a regular file: a reader would wait on it "
                                              "forever; put the file itself there")


def _check_tensor(name: str, key: str, entry: dict[str, Any], shape: tuple[int, ...],
                  headers: dict[str, tuple[str, dict]], required: str | None, report: VerifyReport) -> None:
    """Shape and dtype of one expected tensor (and its FP8 scale); `required`: the one dtype the
    family stores it in (None: any weight dtype, or FP8)."""
    dtype, actual = entry["dtype"], tuple(entry["shape"])
    if actual != shape:
        report.add_config(name, key, f"shape {actual}, expected {shape}")
    if required is not None:
        if dtype != required:
            report.add_config(name, key, f"dtype {dtype}, expected {required}")
        return
    if dtype in WEIGHT_DTYPES:
        return
    if dtype != FP8_DTYPE:
        report.add_config(name, key, f"dtype {dtype}, expected one of {sorted(WEIGHT_DTYPES)} or {FP8_DTYPE}")
        return
    scale_key = key + SCALE_SUFFIX
    if len(shape) != 2:
        report.add_config(name, key, f"{FP8_DTYPE} tensor of shape {shape}: only 2-D weights are block-quantized")
        return
    if scale_key not in headers:
        report.add_config(name, key, f"{FP8_DTYPE} tensor without {scale_key}")
        return
    scale_file, scale_entry = headers[scale_key]
    block_shape = tuple(-(-dim // FP8_BLOCK) for dim in shape)
    if tuple(scale_entry["shape"]) != block_shape:
        report.add_config(scale_file, scale_key, f"shape {tuple(scale_entry['shape'])}, expected {block_shape} "
                                          f"({FP8_BLOCK}x{FP8_BLOCK} blocks of {shape})")
    if scale_entry["dtype"] not in SCALE_DTYPES:
        report.add_config(scale_file, scale_key,
                          f"dtype {scale_entry['dtype']}, expected one of {sorted(SCALE_DTYPES)}")


def verify_checkpoint(path: str | Path, fmt: HfFormat, args: Any = None) -> VerifyReport:
    """Check a checkpoint directory's structure, shapes and dtypes from headers only.

    Args:
        path: an HF checkpoint directory (config.json plus model.safetensors or a
            sharded `model.safetensors.index.json`).
        fmt: the family's `HfFormat` (its spec's `hf_format`): config.json's reader, the
            state-dict adapter, the model on meta.
        args: its architecture when the caller has read config.json already (else read here).

    Returns:
        A report; `report.ok` is False when any problem was found.

    Raises:
        FileNotFoundError: `path` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint directory")
    report = VerifyReport(str(path), args=args)
    if args is None:
        try:
            report.args = fmt.read_config(path)
        except (ValueError, FileNotFoundError, TypeError) as exc:
            report.add("config.json", None, f"does not load: {exc}")
    _check_weights(path, fmt, report)
    _special_entries(path, report)
    return report


def _check_weights(path: Path, fmt: HfFormat, report: VerifyReport) -> None:
    indexed = _index(path, report)
    if indexed is None:
        return
    weight_map, source = indexed
    sharded = bool(weight_map)
    files = sorted(set(weight_map.values())) if sharded else [SINGLE_NAME]
    report.num_files = len(files)
    headers, readable = _read_headers(path, files, weight_map, source, report)
    if not sharded:
        weight_map = {key: SINGLE_NAME for key in headers}
    # Without a config, or with no file read nor listed, there is nothing to compare.
    if report.args is not None and (readable or weight_map):
        _check_against_model(fmt, report.args, headers, weight_map, INDEX_NAME if sharded else SINGLE_NAME, report)


def _read_headers(path: Path, files: list[str], weight_map: dict[str, str], source: Path | None,
                  report: VerifyReport) -> tuple[dict[str, tuple[str, dict]], set[str]]:
    """(key -> (file, header entry) over all readable shards, their names); index/header
    mismatches reported."""
    headers: dict[str, tuple[str, dict]] = {}
    readable: set[str] = set()
    for name in files:
        kind = kind_of(path / name) if isinstance(name, str) and name and "\0" not in name else None
        if kind in BLOCKING_KINDS:  # never opened: it would not end
            report.add(printable(name), None, f"is {kind}, not a regular file: a reader would wait on it forever")
            continue
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
            header, _ = read_header(file)
        except (ValueError, OSError) as exc:
            report.add(name, None, str(exc))
            continue
        readable.add(name)
        report.files.append(file)
        for key, entry in header.items():
            if source is not None and key not in weight_map:
                continue  # a truncated view links whole shards of its source and lists the layers it keeps
            report.num_tensors += 1
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
    return headers, readable


def _check_against_model(fmt: HfFormat, args: Any, headers: dict[str, tuple[str, dict]],
                         weight_map: dict[str, str], listing: str, report: VerifyReport) -> None:
    """Every expected tensor present with its shape and dtype; nothing unexpected.

    `listing` is the file a missing key is reported against (the index, or the
    single safetensors file). Bounded by what is stored, not by what config.json claims.
    """
    # What the files hold (the index's count when a shard is missing: reported already).
    stored = max(sum(1 for key in headers if not key.endswith(SCALE_SUFFIX)), len(weight_map))
    try:
        adapter = fmt.adapter(args)
    except ValueError as exc:  # an architecture the family's HF names do not cover yet: glmtune's gap, not the files'
        report.add("config.json", None, f"its tensors cannot be checked: {exc}")
        return
    if sum(adapter.layer_counts.values()) > stored:  # each layer has tensors of its own
        layers = " and ".join(f"{count:,} {kind}" for kind, count in adapter.layer_counts.items())
        report.add_config(listing, None, f"holds {stored:,} tensors, fewer than config.json's {layers}: not this "
                                         "config's weights")
        return
    try:
        model = _meta_model(fmt, args)
    except ValueError as exc:
        report.add_config("config.json", None, f"does not load: {exc}")
        report.args = None  # no model to describe either
        return
    expected, limit = set(), stored + _MISSING_LISTED
    for key, shape in expected_items(fmt, args, model, adapter):
        if len(expected) == limit:  # more expected than stored and listed: the rest is more of the same
            report.add_config(listing, None, f"config.json implies more than {limit:,} tensors; the checkpoint "
                                             f"holds {stored:,} (the comparison stopped here)")
            report.num_expected = len(expected)
            return
        expected.add(key)
        if key in headers:
            name, entry = headers[key]
            _check_tensor(name, key, entry, shape, headers, adapter.required_dtype(key), report)
            report.num_params += math.prod(entry["shape"])
        elif key not in weight_map:  # listed keys absent from their file were reported above
            report.add_config(listing, key, "missing")
    report.num_expected = len(expected)
    _report_unexpected(expected, headers, frozenset(map(adapter.hf_prefix, adapter.tied_keys)), report)


def _report_unexpected(expected: set[str], headers: dict[str, tuple[str, dict]], tied: frozenset[str],
                       report: VerifyReport) -> None:
    """Each stored tensor the model has no place for (`tied`: the HF names of tied tensors, not stored)."""
    for key, (name, _) in headers.items():
        if key in expected:
            continue
        base = key[: -len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else None
        if base in expected and headers.get(base, ("", {}))[1].get("dtype") == FP8_DTYPE:
            continue  # the scale of an FP8 weight, checked with its weight
        hint = " (tie_word_embeddings: lm_head shares the embedding)" if key in tied else ""
        report.add_config(name, key, f"unexpected tensor (not part of this config's model){hint}")


def format_report(report: VerifyReport) -> list[str]:
    """Human-readable lines: one per problem, then a summary (its figures from the headers that
    passed the checks only)."""
    lines = [str(p) for p in report.problems]
    verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    lines.append(f"{report.path}: {verdict}; {report.num_files} file(s), {report.num_tensors} tensors, "
                 f"{report.num_bytes:,} bytes, {report.num_params:,} params checked")
    return lines


# -- the gate before a load ------------------------------------------------------------
# (directory, args) -> (path, size, mtime, inode) of the files a passing check read: a command
# asks for the same directory's architecture several times, and a GLM-5 check takes a second.
_PASSED: dict[tuple[str, str], tuple] = {}


def _stamp(files: list[Path]) -> tuple:
    try:
        return tuple((str(f), s.st_size, s.st_mtime_ns, s.st_ino) for f in files for s in [os.stat(f)])
    except OSError:
        return ()


def check_loadable(path: str | Path, fmt: HfFormat, args: Any, against_config_only: bool = False) -> None:
    """Refuse an HF directory whose files cannot load as the model `args` (its config.json, read
    by `fmt`, the family's `HfFormat`) describes: the first problem `verify_checkpoint` finds, as
    one sentence naming the file and the tensor, before anything is allocated (headers and the
    meta-device model only).

    `against_config_only`: only what says the weights are another model than the config's
    (shapes, dtypes, tensors missing or unexpected, sizes past any machine), for a command that
    reads the architecture and leaves a missing or damaged file to the load (or to preflight's
    shard check)."""
    path = Path(path)
    key = (os.path.realpath(path), repr(args), against_config_only)
    passed = _PASSED.get(key)
    if passed and passed[1] == _stamp(passed[0]):
        return
    report = verify_checkpoint(path, fmt, args)
    problems = [p for p in report.problems if p.against_config or not against_config_only]
    if not problems:
        files = [path / "config.json", *report.files]
        _PASSED[key] = (files, _stamp(files))
        return
    first, count = problems[0], len(problems)
    where = path if first.file == str(path) else path / first.file
    listed = f"{count} problems; " if count > 1 else ""
    raise ValueError(f"{where}: {f'{first.key}: ' if first.key else ''}{first.message} ({listed}not a checkpoint "
                     f"glmtune can load as its config.json describes; `glmtune inspect {path} --verify` lists "
                     "every problem)")
