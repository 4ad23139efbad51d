"""glmtune/checkpoint/pickle_scan.py: what a checkpoint stores passes (tensors of every dtype a run
holds, optimizer values, RNG states); anything that names a callable, another protocol's way of
naming one, or is not a torch.save archive is refused before anything is unpickled."""

from __future__ import annotations

import collections
import io
import os
import pickle
import random

import pytest
import torch

from glmtune.checkpoint import pickle_scan
from glmtune.checkpoint.pickle_scan import check_torch_save


def _saved(value, **options) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer, **options)
    return buffer.getvalue()


class _System:
    def __reduce__(self):
        return (os.system, ("true",))


class _Eval:
    def __reduce__(self):
        return (eval, ("1",))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16]
ACCEPTED = {
    **{f"tensor {dtype}": torch.zeros(3, dtype=dtype) for dtype in DTYPES},
    "optimizer values": {"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a.weight"], "foreach": None, "amsgrad": False},
    "rng states": {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": []},
    "ordered dict": collections.OrderedDict(a=torch.ones(2)),
}


@pytest.fixture(params=[True, False], ids=["size first", "read then measured"])
def reader_kind(request, monkeypatch):
    """Both ways of sizing the pickle: torch >= 2.12's reader tells it before reading, torch 2.11's not."""
    if request.param and not pickle_scan._SIZE_BEFORE_READING:
        pytest.skip("this torch's reader cannot tell a record's size before reading it")
    monkeypatch.setattr(pickle_scan, "_SIZE_BEFORE_READING", request.param)
    return request.param


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_what_a_checkpoint_stores_passes(case, reader_kind):
    stream = io.BytesIO(b"prefix" + _saved(ACCEPTED[case]))
    stream.seek(6)
    check_torch_save(stream, "item")
    assert stream.tell() == 6  # left where it was, for torch.load


REFUSED = {
    "os.system": (_saved({"x": _System()}), "its pickle names 'posix.system'"),
    "eval": (_saved([_Eval()]), "its pickle names '__builtin__.eval'"),
    "a module": (_saved(torch.nn.Linear(2, 2)), "its pickle names 'torch.nn.modules.linear.Linear'"),
    "protocol 4": (_saved(torch.zeros(2), pickle_protocol=4), "opcode STACK_GLOBAL"),
    "a bare pickle": (pickle.dumps({"x": _System()}), "not a tensor archive as torch.save writes it"),
    "truncated": (_saved(torch.zeros(2))[:200], "not a tensor archive as torch.save writes it"),
    "empty": (b"", "not a tensor archive as torch.save writes it"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_anything_else_is_refused_before_unpickling(case, reader_kind):
    data, fragment = REFUSED[case]
    with pytest.raises(ValueError) as caught:
        check_torch_save(io.BytesIO(data), "ckpt/__0_0.distcp: the stored x")
    message = str(caught.value)
    assert message.startswith("ckpt/__0_0.distcp: the stored x: ") and fragment in message, message
    assert "\n" not in message


def test_a_torchscript_archive_is_refused():
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    with pytest.raises(ValueError, match="not a tensor archive as torch.save writes it"):
        check_torch_save(io.BytesIO(buffer.getvalue()), "x")


def test_a_pickle_larger_than_any_checkpoint_value_is_refused(reader_kind, monkeypatch):
    data = _saved({"names": [f"{i:03d}" * 30 for i in range(100)]})  # 9,000 characters, none repeated
    check_torch_save(io.BytesIO(data), "item")
    monkeypatch.setattr(pickle_scan, "MAX_PICKLE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"item: its pickle is [19],\d{3} bytes, more than any tensor or optimizer value"):
        check_torch_save(io.BytesIO(data), "item")
