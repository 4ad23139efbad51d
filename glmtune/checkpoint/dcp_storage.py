"""DCP storage that loads without unpickling: JSON metadata, weights-only values.

torch.distributed.checkpoint's file storage pickles two things that a load then
unpickles with the full unpickler, where a planted file runs code:
  * `.metadata`, the checkpoint's layout (which tensor chunk lies at which byte of which
    file), written with `pickle.dump` and read with `pickle.load`;
  * every non-tensor value of the state dict (an optimizer's `param_groups`: lr, betas,
    the parameter names), stored as `torch.save` bytes inside a `.distcp` file and read
    with `torch.load(weights_only=False)`.

Here the layout is written as JSON instead (`dcp_metadata.json`; no `.metadata` is
written, so no tool is invited to unpickle one) and rebuilt into DCP's dataclasses
field by field, with every type checked. Every stored item (a tensor, or a non-tensor
value) is a torch.save archive; before DCP hands one to torch.load, its pickle's
opcodes are checked (`pickle_scan.py`: only tensors and plain values, decided without
unpickling anything), and a planted item is refused in one sentence naming the file,
the byte it starts at and the value it claims to be. What passes is then read with
torch's weights-only unpickler (non-tensor values here, tensors by DCP itself).

A checkpoint written by glmtune before this file existed has only a pickled `.metadata`;
it is refused with a sentence rather than unpickled (`LegacyCheckpointError`).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from glmtune.checkpoint.pickle_scan import check_torch_save
from glmtune.io.text_limits import printable

METADATA_NAME = "dcp_metadata.json"
PICKLED_METADATA_NAME = ".metadata"  # DCP's own, never read
_FORMAT = "glmtune-dcp-metadata"
_FORMAT_VERSION = 1
# 1 GiB of layout would describe millions of chunks: anything larger is not a glmtune checkpoint.
_MAX_METADATA_BYTES = 1 << 30

# The dtypes a training checkpoint stores (weights, optimizer moments and steps, counters).
_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int16",
           "int8", "uint8", "bool")
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}


class LegacyCheckpointError(ValueError):
    """A DCP checkpoint whose layout exists only as a pickle."""


# ----------------------------------------------------------------------------- encoding


def _name_of(value: Any, table: dict[str, Any]) -> str:
    for name, member in table.items():
        if member == value:
            return name
    raise AssertionError(f"no JSON name for {value!r}")


def _encode_entry(entry: Any) -> dict[str, Any]:
    if isinstance(entry, BytesStorageMetadata):
        return {"kind": "bytes"}
    assert isinstance(entry, TensorStorageMetadata), type(entry)
    props = entry.properties
    return {
        "kind": "tensor",
        "dtype": str(props.dtype).removeprefix("torch."),
        "layout": _name_of(props.layout, _LAYOUTS),
        "memory_format": _name_of(props.memory_format, _MEMORY_FORMATS),
        "requires_grad": bool(props.requires_grad),
        "pin_memory": bool(props.pin_memory),
        "size": list(entry.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks],
    }


def _encode_storage(index: MetadataIndex, info: _StorageInfo) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "file": info.relative_path,
        "file_offset": int(info.offset),
        "length": int(info.length),
        "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
    }


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's Metadata as plain JSON values."""
    planner_data = metadata.planner_data or {}
    assert isinstance(planner_data, dict), type(planner_data)
    return {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "dcp_version": metadata.version,
        "save_id": metadata.storage_meta.save_id if metadata.storage_meta else None,
        "state_dict": {fqn: _encode_entry(e) for fqn, e in metadata.state_dict_metadata.items()},
        "planner_data": {fqn: list(path) for fqn, path in planner_data.items()},
        "storage": [_encode_storage(index, info) for index, info in (metadata.storage_data or {}).items()],
    }


# ----------------------------------------------------------------------------- decoding


class _Fields:
    """Typed reads from one JSON object; any surprise is a ValueError naming where."""

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
        self.value, self.where = value, where

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        item = self.value.get(key)
        if item is None and optional:
            return None
        if not isinstance(item, kind) or (isinstance(item, bool) and kind in (int, (int,))):
            raise ValueError(f"{self.where}.{key}: expected {getattr(kind, '__name__', kind)}, got {item!r:.60}")
        return item

    def ints(self, key: str, optional: bool = False) -> list[int] | None:
        items = self.get(key, list, optional)
        if items is None:
            return None
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise ValueError(f"{self.where}.{key}: expected a list of non-negative integers")
        return items


def _decode_entry(value: Any, where: str) -> Any:
    fields = _Fields(value, where)
    kind = fields.get("kind", str)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise ValueError(f"{where}.kind: {kind!r:.40} is neither 'tensor' nor 'bytes'")
    if fields.get("dtype", str) not in _DTYPES:
        raise ValueError(f"{where}.dtype: {fields.get('dtype', str)!r:.40} is not a torch dtype a checkpoint stores")
    dtype = getattr(torch, fields.get("dtype", str))
    layout, memory_format = fields.get("layout", str), fields.get("memory_format", str)
    if layout not in _LAYOUTS or memory_format not in _MEMORY_FORMATS:
        raise ValueError(f"{where}: unknown layout {layout!r:.40} or memory format {memory_format!r:.40}")
    properties = TensorProperties(dtype=dtype, layout=_LAYOUTS[layout], requires_grad=fields.get("requires_grad", bool),
                                  memory_format=_MEMORY_FORMATS[memory_format], pin_memory=fields.get("pin_memory", bool))
    size = fields.ints("size")
    chunks = []
    for i, chunk in enumerate(fields.get("chunks", list)):
        chunk_fields = _Fields(chunk, f"{where}.chunks[{i}]")
        offsets, sizes = chunk_fields.ints("offsets"), chunk_fields.ints("sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or \
                any(o + n > whole for o, n, whole in zip(offsets, sizes, size)):
            raise ValueError(f"{where}.chunks[{i}]: not a part of a tensor of size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def _decode_storage(value: Any, where: str) -> tuple[MetadataIndex, _StorageInfo]:
    fields = _Fields(value, where)
    relative_path = fields.get("file", str)
    if os.path.isabs(relative_path) or os.sep in relative_path or relative_path in ("", ".", ".."):
        raise ValueError(f"{where}.file: {relative_path!r:.60} is not a file name inside the checkpoint")
    if fields.get("transforms", list, optional=True) is not None:  # DCP's experimental stream extensions
        raise ValueError(f"{where}.transforms: glmtune writes items without transforms")
    offset, length = fields.get("file_offset", int), fields.get("length", int)
    if offset < 0 or length < 0:
        raise ValueError(f"{where}: a negative file_offset or length")
    index = MetadataIndex(fqn=fields.get("fqn", str), offset=fields.ints("offset", optional=True),
                          index=fields.get("index", int, optional=True))
    info = _StorageInfo(relative_path=relative_path, offset=offset, length=length, transform_descriptors=None)
    return index, info


def decode_metadata(value: Any, where: str) -> Metadata:
    """DCP's Metadata rebuilt from `encode_metadata`'s JSON, every field type-checked."""
    fields = _Fields(value, where)
    if fields.get("format", str) != _FORMAT or fields.get("format_version", int) != _FORMAT_VERSION:
        raise ValueError(f"{where}: not a glmtune DCP layout of format version {_FORMAT_VERSION}")
    state_dict = {fqn: _decode_entry(entry, f"{where}.state_dict[{fqn!r:.60}]")
                  for fqn, entry in fields.get("state_dict", dict).items()}
    planner_data = {}
    for fqn, path in fields.get("planner_data", dict).items():
        if not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
            raise ValueError(f"{where}.planner_data[{fqn!r:.60}]: expected a list of keys")
        planner_data[fqn] = tuple(path)
    storage = dict(_decode_storage(item, f"{where}.storage[{i}]")
                   for i, item in enumerate(fields.get("storage", list)))
    meta = StorageMeta(save_id=fields.get("save_id", str, optional=True))
    return Metadata(state_dict_metadata=state_dict, planner_data=planner_data, storage_data=storage,
                    storage_meta=meta, version=fields.get("dcp_version", str, optional=True))


# ----------------------------------------------------------------------------- storage


class JsonMetadataWriter(FileSystemWriter):
    """DCP's file writer, with the layout written as `dcp_metadata.json` instead of a pickle."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        storage = {}
        for write_results in results:
            storage.update({result.index: result.storage_data for result in write_results})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        metadata.version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
        path = os.path.join(os.fspath(self.path), METADATA_NAME)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(encode_metadata(metadata), fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


class JsonMetadataReader(FileSystemReader):
    """DCP's file reader, taking the layout from `dcp_metadata.json`; a pickled one is refused."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._item_names: dict[tuple[str, int], str] = {}  # (file, offset) -> the value stored there

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._read_layout()
        # Which value each stored item claims to be, for the refusal of a planted one (`_slice_file`).
        self._item_names = {(info.relative_path, info.offset): index.fqn
                            for index, info in metadata.storage_data.items()}
        return metadata

    def _read_layout(self) -> Metadata:
        directory = os.fspath(self.path)
        path = os.path.join(directory, METADATA_NAME)
        if not os.path.isfile(path):
            if os.path.isfile(os.path.join(directory, PICKLED_METADATA_NAME)):
                raise LegacyCheckpointError(
                    f"{directory} was written by an older glmtune: its layout is a pickle (.metadata), which "
                    "glmtune no longer unpickles; resume from a checkpoint written by this version or start over")
            raise ValueError(f"{path} is missing")
        if os.path.getsize(path) > _MAX_METADATA_BYTES:
            raise ValueError(f"{path} is larger than any glmtune checkpoint layout")
        with open(path, encoding="utf-8") as fh:
            try:
                value = json.load(fh)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{path} is not valid JSON ({type(exc).__name__})") from None
        metadata = decode_metadata(value, METADATA_NAME)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo: _StorageInfo):
        """One stored item, checked to hold only tensors and plain values before DCP unpickles it."""
        view = super()._slice_file(file, sinfo)
        fqn = printable(self._item_names.get((sinfo.relative_path, sinfo.offset), "item"))[:200]
        where = f"{os.path.join(os.fspath(self.path), sinfo.relative_path)}: the stored {fqn} (byte {sinfo.offset})"
        check_torch_save(view, where)
        return view


def failure_of(exc: BaseException) -> str:
    """One line for a failed DCP load: the first rank's own error (DCP wraps each rank's in a
    CheckpointException whose text is a traceback), a refusal's sentence as it is."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = exc.failures[min(exc.failures)]
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip()
    if isinstance(exc, ValueError) and text:
        return text.splitlines()[0]
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else 'no detail'}"


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with the weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
