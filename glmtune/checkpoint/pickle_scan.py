"""Refuse a torch.save file before anything in it is unpickled, unless it holds only tensors and plain values.

A checkpoint's tensors, its optimizer's non-tensor values (lr, betas, parameter names) and its
RNG states are torch.save archives: a zip of records, one of which, `data.pkl`, is a pickle that
rebuilds the object. torch's weights-only unpickler already refuses, at load time, every global
outside its allowlist; this check runs first and decides from the pickle's opcodes alone
(`pickletools.genops` parses them and runs nothing) whether the file is what glmtune writes:

  * the archive has only the records torch.save writes (`data.pkl`, `data/<n>`, version marks),
    read with torch's own zip reader, so the bytes checked are the bytes torch would load;
  * `data.pkl` uses only the opcodes of numbers, strings, tuples, lists, dicts, `None`/booleans,
    tensor storages (BINPERSID) and calls, and its only globals are
    torch's tensor rebuilders (`torch._utils._rebuild_tensor_v2`/`_v3`), `collections.OrderedDict`,
    the storage classes (`torch.<dtype>Storage`, `torch.storage.UntypedStorage`) and a few dtypes.

Anything else (a planted `__reduce__`, `os.system`, a protocol-4 `STACK_GLOBAL` naming a
callable, a TorchScript archive, a legacy non-zip pickle, a truncated archive) is a
`ValueError` naming the file, and torch.load never sees it.
"""

from __future__ import annotations

import pickletools
import re
from typing import IO

import torch

_PICKLE = "data.pkl"
# The records torch.save writes beside the pickle: version marks and one record per storage.
_RECORD = re.compile(r"data\.pkl|\.format_version|\.storage_alignment|byteorder|version|\.data/serialization_id"
                     r"|data/\d{1,12}")
# Non-tensor values of an optimizer, a scheduler or an RNG state are small; a larger pickle is not glmtune's.
MAX_PICKLE_BYTES = 64 << 20
# How torch.save rebuilds a tensor: v2 with a typed storage class, v3 (dtypes without one: float8,
# uint16-64) with an untyped storage and the dtype named.
ALLOWED_GLOBALS = frozenset({"torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3",
                             "torch.storage UntypedStorage", "collections OrderedDict",
                             *(f"torch {name}" for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                                                            "uint64"))})
_STORAGE_GLOBAL = re.compile(r"torch [A-Z][A-Za-z0-9_]{0,40}Storage")
# Data, containers, memo, calls and persistent ids (tensor storages): what protocol 2, which
# torch.save uses, needs for tensors and plain values. Left out: STACK_GLOBAL, INST, OBJ,
# NEWOBJ(_EX), BUILD, EXT1/2/4, PERSID and every other way of naming or building an object.
ALLOWED_OPCODES = frozenset({
    "PROTO", "STOP", "FRAME", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "LIST",
    "EMPTY_DICT", "SETITEM", "SETITEMS", "DICT",
    "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET", "PUT", "GET",
    "GLOBAL", "REDUCE", "BINPERSID",
})


def unsafe_reason(pickled: bytes) -> str | None:
    """Why the pickle `pickled` is not one of tensors and plain values (None when it is)."""
    try:
        for opcode, arg, position in pickletools.genops(pickled):
            if opcode.name not in ALLOWED_OPCODES:
                return f"its pickle uses opcode {opcode.name} (byte {position}), which no tensor or plain value needs"
            if opcode.name == "GLOBAL" and arg not in ALLOWED_GLOBALS and not _STORAGE_GLOBAL.fullmatch(str(arg)):
                return f"its pickle names {str(arg).replace(' ', '.')[:120]!r}, which a glmtune checkpoint never holds"
    except ValueError as exc:  # pickletools on a malformed or cut-short stream
        return f"its pickle is malformed ({exc})"
    return None


# torch >= 2.12's reader tells a record's size before reading it; torch 2.11's (the GPU image's) does not.
_SIZE_BEFORE_READING = hasattr(torch._C.PyTorchFileReader, "get_record_size")


def _pickle_record(reader: torch._C.PyTorchFileReader) -> tuple[bytes | None, int | None]:
    """(`data.pkl`'s bytes, unless larger than MAX_PICKLE_BYTES; its size, None without one). Where the
    reader cannot tell the size first, the record is read and then measured: it is never unpickled
    here either way, and it is no larger than the archive the caller opened."""
    if not reader.has_record(_PICKLE):
        return None, None
    if _SIZE_BEFORE_READING:
        size = reader.get_record_size(_PICKLE)
        return (reader.get_record(_PICKLE) if size <= MAX_PICKLE_BYTES else None), size
    pickled = reader.get_record(_PICKLE)
    return (pickled if len(pickled) <= MAX_PICKLE_BYTES else None), len(pickled)


def check_torch_save(stream: IO[bytes], where: str) -> None:
    """ValueError naming `where` unless `stream`, from its current position, is a torch.save
    archive of tensors and plain values (module docstring). The stream is left where it was."""
    start = stream.tell()
    try:
        reader = torch._C.PyTorchFileReader(stream)
        records = reader.get_all_records()
        pickled, size = _pickle_record(reader)
    except RuntimeError:  # torch's zip reader: not a zip archive, cut short, a bad record
        raise ValueError(f"{where}: not a tensor archive as torch.save writes it (truncated or damaged); "
                         "nothing was unpickled") from None
    finally:
        stream.seek(start)
    odd = sorted(name for name in records if not _RECORD.fullmatch(name))
    if size is None or odd:
        found = f"record {odd[0][:80]!r}" if odd else f"no {_PICKLE}"
        raise ValueError(f"{where}: not a tensor archive as torch.save writes it ({found}); nothing was unpickled")
    if pickled is None:
        raise ValueError(f"{where}: its pickle is {size:,} bytes, more than any tensor or optimizer value; "
                         "nothing was unpickled")
    reason = unsafe_reason(bytes(pickled))
    if reason:
        raise ValueError(f"{where}: refused before unpickling: {reason}")
