"""The top-K sidecar: round trip, refusals, a killed writer (torn tail, a real SIGKILL) reopening to
its last complete record, resume, drop_trailing."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from glmtune.distill.topk_store import INDEX, RECORDS, TopKReader, TopKWriter


def _record(n: int, k: int, seed: int, missing: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 100, size=(n, k)).astype(np.int32)
    logprobs = -rng.random((n, k)).astype(np.float32) * 5
    if missing:
        ids[:, -missing:] = -1
        logprobs[:, -missing:] = -math.inf
    return ids, logprobs


def test_round_trip_float32_with_missing_entries_and_generated(tmp_path):
    rows = {f"r{i}": _record(i + 1, 4, i, missing=i % 2) for i in range(5)}
    rows["empty"] = (np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32))
    with TopKWriter(tmp_path / "topk", k=4, vocab_size=100) as writer:
        for row, (ids, lp) in rows.items():
            writer.append(row, torch.from_numpy(ids), lp, generated=ids[:, 0])
    reader = TopKReader(tmp_path / "topk")
    assert reader.k == 4 and reader.row_ids == list(rows) and "r3" in reader and "nope" not in reader
    for row, (ids, lp) in rows.items():
        got_ids, got_lp = reader.get(row)
        assert got_ids.dtype == torch.int64 and got_lp.dtype == torch.float32
        assert torch.equal(got_ids, torch.from_numpy(ids).long()) and torch.equal(got_lp, torch.from_numpy(lp))
        assert torch.equal(reader.generated(row), torch.from_numpy(ids[:, 0]).long())
    assert (tmp_path / "topk" / RECORDS).stat().st_size == sum(len(i) * (4 + 4 * 8) for i, _ in rows.values())


def test_float16_storage_keeps_missing_and_clamps_far_tail(tmp_path):
    ids, lp = _record(3, 2, 0, missing=1)
    lp[0, 0] = -1e6  # finite, below float16's range: stored as its lowest finite value, not as "no entry"
    with TopKWriter(tmp_path / "t", k=2, logprob_dtype="float16") as writer:
        writer.append("a", ids, lp)
    got_ids, got_lp = TopKReader(tmp_path / "t").get("a")
    assert torch.isneginf(got_lp[:, 1]).all() and (got_ids[:, 1] == -1).all()
    assert got_lp[0, 0] == -65504.0
    assert torch.allclose(got_lp[1:, 0], torch.from_numpy(lp[1:, 0]), atol=5e-3)
    assert generated_unknown(TopKReader(tmp_path / "t"), "a")


def generated_unknown(reader, row) -> bool:
    return bool((reader.generated(row) == -1).all())


@pytest.mark.parametrize(("change", "message"), [
    (lambda i, lp: (i, np.where(lp == lp.max(), np.nan, lp)), "NaN or above 0"),
    (lambda i, lp: (i, lp + 10), "NaN or above 0"),
    (lambda i, lp: (i + 100, lp), "outside \\[0, 100\\)"),
    (lambda i, lp: (np.where(i == i.max(), -1, i), lp), "come together"),
    (lambda i, lp: (i[:, :2], lp[:, :2]), "must both be \\[n, 3\\]"),
    (lambda i, lp: (i, lp[:1]), "must both be \\[n, 3\\]"),
])
def test_malformed_records_are_refused_and_nothing_is_written(tmp_path, change, message):
    ids, lp = change(*_record(2, 3, 1))
    with TopKWriter(tmp_path / "t", k=3, vocab_size=100) as writer, pytest.raises(ValueError, match=message):
        writer.append("x", ids, lp)
    assert TopKReader(tmp_path / "t").row_ids == [] and (tmp_path / "t" / RECORDS).stat().st_size == 0


def test_duplicate_row_header_mismatch_and_foreign_directory_are_refused(tmp_path):
    with TopKWriter(tmp_path / "t", k=3) as writer:
        writer.append("x", *_record(2, 3, 1))
        with pytest.raises(ValueError, match="already stored"):
            writer.append("x", *_record(2, 3, 2))
    with pytest.raises(ValueError, match="written with k 3, not 4"):
        TopKWriter(tmp_path / "t", k=4)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="not a top-K sidecar"):
        TopKWriter(tmp_path / "other", k=3)
    assert (tmp_path / "other" / "mine.txt").read_text() == "keep"


def test_torn_tail_reads_as_prefix_and_reopened_writer_resumes(tmp_path):
    path = tmp_path / "t"
    records = {f"r{i}": _record(3, 2, i) for i in range(4)}
    with TopKWriter(path, k=2) as writer:
        for row in ("r0", "r1", "r2"):
            writer.append(row, *records[row])
    # What a kill can leave: r2's bytes half gone (its index line names lost bytes only after a power
    # loss) -- here the record is whole but its index line torn, plus half a record past it.
    index = (path / INDEX).read_bytes()
    (path / INDEX).write_bytes(index[:-10])
    with open(path / RECORDS, "ab") as fh:
        fh.write(b"\x01" * 17)
    assert TopKReader(path).row_ids == ["r0", "r1"]
    with TopKWriter(path, k=2) as writer:
        assert writer.row_ids == ["r0", "r1"]
        writer.append("r2", *records["r2"])
        writer.append("r3", *records["r3"])
    reader = TopKReader(path)
    assert reader.row_ids == ["r0", "r1", "r2", "r3"]
    for row, (ids, lp) in records.items():
        assert torch.equal(reader.get(row)[1], torch.from_numpy(lp))


def test_index_line_past_lost_bytes_is_dropped_and_corruption_is_refused(tmp_path):
    path = tmp_path / "t"
    with TopKWriter(path, k=2) as writer:
        for i in range(3):
            writer.append(f"r{i}", *_record(3, 2, i))
    size = (path / RECORDS).stat().st_size
    with open(path / RECORDS, "r+b") as fh:
        fh.truncate(size - 5)  # the last record's bytes lost (a crash before the page cache reached disk)
    assert TopKReader(path).row_ids == ["r0", "r1"]
    lines = (path / INDEX).read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"crc32": ', b'"crc32": 1')
    (path / INDEX).write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="CRC does not match"):
        TopKReader(path).get("r0")
    lines[0] = b"{not json"
    (path / INDEX).write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=f"{INDEX}:1: not a JSON index line"):
        TopKReader(path)


def test_drop_trailing_removes_the_unkept_tail_only(tmp_path):
    path = tmp_path / "t"
    with TopKWriter(path, k=2) as writer:
        for i in range(4):
            writer.append(f"r{i}", *_record(2, 2, i))
        assert writer.drop_trailing({"r0", "r1", "r3"}) == 0  # r3 is kept: nothing behind it goes
        assert writer.drop_trailing({"r0", "r1"}) == 2
        writer.append("r9", *_record(1, 2, 9))
    reader = TopKReader(path)
    assert reader.row_ids == ["r0", "r1", "r9"]
    assert torch.equal(reader.get("r9")[0], torch.from_numpy(_record(1, 2, 9)[0]).long())


_KILLED_WRITER = """
import sys, numpy as np
from glmtune.distill.topk_store import TopKWriter
writer = TopKWriter(sys.argv[1], k=8, vocab_size=1000)
rng = np.random.default_rng(0)
for i in range(100000):
    ids = rng.integers(0, 1000, size=(200, 8)).astype(np.int32)
    writer.append(f"row{i}", ids, -rng.random((200, 8)).astype(np.float32))
"""


def test_a_sigkilled_writer_leaves_a_readable_prefix_that_resumes(tmp_path):
    path = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)])
    try:
        deadline = time.monotonic() + 120
        while not ((path / INDEX).exists() and (path / INDEX).read_bytes().count(b"\n") >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, "the writer stopped or stalled"
            time.sleep(0.01)  # polling for the event (20 stored rows), not a fixed wait
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = TopKReader(path).row_ids
    assert len(done) >= 20 and done == [f"row{i}" for i in range(len(done))]
    with TopKWriter(path, k=8, vocab_size=1000) as writer:
        writer.append("after", *_record(5, 8, 0))
    reader = TopKReader(path)
    assert reader.row_ids == [*done, "after"]
    for row in reader.row_ids:
        reader.get(row)  # every CRC matches
    assert json.loads((path / "header.json").read_text())["k"] == 8
