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
field by field, with every type checked; non-tensor values are read with torch's
weights-only unpickler, which builds tensors, numbers, strings and plain containers
and refuses any other global. Tensor data was already read weights-only by DCP.

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

METADATA_NAME = "dcp_metadata.json"
PICKLED_METADATA_NAME = ".metadata"  # DCP's own, never read
_FORMAT = "glmtune-dcp-metadata"
_FORMAT_VERSION = 1
# 1 GiB of layout would describe millions of chunks: anything larger is not a glmtune checkpoint.
_MAX_METADATA_BYTES = 1 << 30

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
    dtype = getattr(torch, fields.get("dtype", str), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}.dtype: {fields.get('dtype', str)!r:.40} is not a torch dtype")
    layout, memory_format = fields.get("layout", str), fields.get("memory_format", str)
    if layout not in _LAYOUTS or memory_format not in _MEMORY_FORMATS:
        raise ValueError(f"{where}: unknown layout {layout!r:.40} or memory format {memory_format!r:.40}")
    properties = TensorProperties(dtype=dtype, layout=_LAYOUTS[layout], requires_grad=fields.get("requires_grad", bool),
                                  memory_format=_MEMORY_FORMATS[memory_format], pin_memory=fields.get("pin_memory", bool))
    chunks = []
    for i, chunk in enumerate(fields.get("chunks", list)):
        chunk_fields = _Fields(chunk, f"{where}.chunks[{i}]")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk_fields.ints("offsets")),
                                           sizes=torch.Size(chunk_fields.ints("sizes"))))
    return TensorStorageMetadata(properties=properties, size=torch.Size(fields.ints("size")), chunks=chunks)


def _decode_storage(value: Any, where: str) -> tuple[MetadataIndex, _StorageInfo]:
    fields = _Fields(value, where)
    relative_path = fields.get("file", str)
    if os.path.isabs(relative_path) or os.sep in relative_path or relative_path in ("", ".", ".."):
        raise ValueError(f"{where}.file: {relative_path!r:.60} is not a file name inside the checkpoint")
    transforms = fields.get("transforms", list, optional=True)
    if transforms is not None and not all(isinstance(t, str) for t in transforms):
        raise ValueError(f"{where}.transforms: expected a list of strings")
    index = MetadataIndex(fqn=fields.get("fqn", str), offset=fields.ints("offset", optional=True),
                          index=fields.get("index", int, optional=True))
    info = _StorageInfo(relative_path=relative_path, offset=fields.get("file_offset", int),
                        length=fields.get("length", int), transform_descriptors=transforms)
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
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


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with the weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
