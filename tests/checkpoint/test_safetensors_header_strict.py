"""The one safetensors header reader refuses what the safetensors library refuses (issue 44,
re-test M3), so `glmtune inspect --verify` is never weaker than what loads.

Overlapping data_offsets (lm_head and the embedding sharing bytes) and a `__metadata__` value
that is not a string verified "OK" while safetensors (and so eval, transformers, vLLM) refused
the file, and the summary quoted the header's numbers ("1,000,000,008,965,856 bytes",
"1,208,925,819,614,629,176,423,352 params checked"). Each hostile header here is refused by
the library itself and by `read_header`; what the library reads, `read_header` reads too.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from glmtune.checkpoint.safetensors_header import read_header
from glmtune.cli import main
from tests.checkpoint_fixtures import weight_map

W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
V = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


def _file(path: Path, header: dict | bytes, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


REFUSED = {  # (header, data bytes) -> what read_header says
    "overlapping ranges": ({"w": W, "v": {**V, "data_offsets": [0, 8]}}, 16, "overlaps the tensor before it"),
    "a gap": ({"w": W, "v": {**V, "data_offsets": [12, 20]}}, 20, "leaves bytes 8..12 unused"),
    "not from 0": ({"w": {**W, "data_offsets": [4, 12]}}, 12, "leaves bytes 0..4 unused"),
    "metadata a number": ({"w": W, "__metadata__": {"format": 1}}, 8, "__metadata__ is not an object of strings"),
    "metadata a list": ({"w": W, "__metadata__": [{}, {}]}, 8, "__metadata__ is not an object of strings"),
    "range not its size": ({"w": {**W, "dtype": "BF16"}}, 8, r"data_offsets \[0, 8\] \(8 bytes\), but BF16 \(2,\) "
                                                              "needs 4"),
    "shape overflows 64 bits": ({"w": {**W, "shape": [2**40, 2**40]}}, 8, "more than 2\\^64 elements"),
    "overflow before a zero": ({"w": {**W, "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}, 0,
                               "more than 2\\^64 elements"),
    "offset past 2^64": ({"w": {**W, "data_offsets": [0, 2**64]}}, 8, "no data_offsets"),
    "unknown dtype": ({"w": {**W, "dtype": "f32"}}, 8, "dtype 'f32', not one safetensors reads"),
    "trailing bytes": ({"w": W}, 12, "4 trailing bytes"),
    "cut short": ({"w": W}, 6, "truncated safetensors file"),
    "not UTF-8": (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"a": "\xff"}}', 8,
                  "not UTF-8"),
    "trailing garbage": (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}\x00\x00', 8,
                         "not valid JSON"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_safetensors_refuses_read_header_refuses(tmp_path, case):
    header, size, said = REFUSED[case]
    file = _file(tmp_path / "x.safetensors", header, b"\0" * size)
    with pytest.raises(Exception):  # the library's own verdict: the premise of the case
        safe_open(str(file), framework="pt")
    with pytest.raises(ValueError, match=said):
        read_header(file)


def test_a_tensor_named_twice_is_refused(tmp_path):
    """Stricter than the library, which keeps one of the two silently."""
    raw = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, ' \
          b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    with pytest.raises(ValueError, match="'w' given twice"):
        read_header(_file(tmp_path / "x.safetensors", raw, b"\0" * 8))


READ = {  # what the library reads, read_header reads
    "two tensors": ({"w": W, "v": V}, 16),
    "empty tensors sharing an offset": ({"a": {**W, "shape": [0], "data_offsets": [0, 0]},
                                         "b": {**W, "shape": [0], "data_offsets": [0, 0]}}, 0),
    "metadata null": ({"w": W, "__metadata__": None}, 8),
    "metadata strings": ({"w": W, "__metadata__": {"format": "pt"}}, 8),
    "an extra field": ({"w": {**W, "note": 1}}, 8),
    "leading spaces": (b'  {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8),
    "F8_E8M0": ({"w": {**W, "dtype": "F8_E8M0", "data_offsets": [0, 2]}}, 2),
}


@pytest.mark.parametrize("case", list(READ))
def test_what_safetensors_reads_read_header_reads(tmp_path, case):
    header, size = READ[case]
    file = _file(tmp_path / "x.safetensors", header, b"\0" * size)
    with safe_open(str(file), framework="pt") as handle:
        keys = set(handle.keys())
    entries, start = read_header(file)
    assert set(entries) == keys and start + size == file.stat().st_size


def _edit_header(file: Path, edit) -> None:
    """Rewrite a shard's header with `edit(header)`, its data bytes unchanged."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    _file(file, header, raw[8 + length:])


def _verify(ckpt: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["inspect", str(ckpt), "--verify"])
    return code, out.getvalue()


def _overlap(header: dict) -> None:
    first, second = [k for k in header if k != "__metadata__"][:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    header[second]["shape"], header[second]["dtype"] = header[first]["shape"], header[first]["dtype"]


HOSTILE_SHARDS = {  # a shard's header edited -> what verify says of it
    "overlap": (_overlap, "overlaps the tensor before it"),
    "metadata junk": (lambda h: h.__setitem__("__metadata__", {"format": [{}] * 1000}),
                      "__metadata__ is not an object of strings"),
    "a huge shape": (lambda h: h[next(k for k in h if k != "__metadata__")].__setitem__("shape", [2**40, 2**40]),
                     "more than 2\\^64 elements"),
}


@pytest.mark.parametrize("case", list(HOSTILE_SHARDS))
def test_verify_names_the_shard_and_counts_only_what_passed(ckpt, case):
    edit, said = HOSTILE_SHARDS[case]
    shard = weight_map(ckpt)["model.layers.0.self_attn.q_a_proj.weight"]
    _edit_header(ckpt / shard, edit)
    with pytest.raises(Exception):  # safetensors refuses the shard: so does eval
        safe_open(str(ckpt / shard), framework="pt")
    code, out = _verify(ckpt)
    assert code == 1, out
    assert any(line.startswith(f"{shard}: corrupt safetensors header") and re.search(said, line)
               for line in out.splitlines()), out
    summary = out.splitlines()[-1]
    on_disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    figures = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:bytes|params)", summary)]
    assert figures and all(n <= on_disk for n in figures), summary  # never the header's numbers

