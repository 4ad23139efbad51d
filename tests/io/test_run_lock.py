"""glmtune.io.run_lock: a run directory's record, and its lock as a run and other commands see it."""

from __future__ import annotations

import pytest

from glmtune.io.run_lock import LOCK_FILE, RUN_FILE, RunLock, lock_holder, read_run_record, write_run_record


def test_run_record_round_trip_and_refusals(tmp_path):
    assert read_run_record(tmp_path) is None
    write_run_record(tmp_path, {"run_id": "abc", "started": "now"})
    assert read_run_record(tmp_path) == {"run_id": "abc", "started": "now"}
    (tmp_path / RUN_FILE).write_text('{"name": "not a run"}')
    with pytest.raises(ValueError, match="not a glmtune run record"):
        read_run_record(tmp_path)
    (tmp_path / RUN_FILE).write_text("[" * 100 + "]" * 100)
    with pytest.raises(ValueError, match="unreadable run record"):
        read_run_record(tmp_path)


def test_a_marked_lock_names_its_holder_until_released(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and lock.held and not lock.existed
    lock.mark()
    holder = lock_holder(tmp_path)
    assert holder is not None and holder.startswith("glmtune train (pid ")
    with pytest.raises(ValueError, match=r"^glmtune train \(pid "):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not lock.held and lock_holder(tmp_path) is None
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"released: {holder}, ended ")
    again = RunLock(tmp_path)
    assert again.acquire() is None and again.existed  # a released lock is not stale
    again.release()
    assert (tmp_path / LOCK_FILE).read_text().startswith("released: ")  # unmarked: left as it was


def test_an_unmarked_lock_leaves_no_file_and_a_stale_one_is_taken_over(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text("glmtune train (pid 1 on gone, started then)\n")  # nobody holds the flock
    assert lock_holder(tmp_path) is None
    stale = RunLock(tmp_path)
    assert stale.acquire() == "glmtune train (pid 1 on gone, started then)"
    stale.release()
