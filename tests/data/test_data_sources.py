"""Reading rows from JSONL, Parquet and `datasets` directories, with origins."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_test_helpers import chat

from glmtune.data.sources import expand_inputs, file_sha256, inputs_sha256, read_rows


def test_jsonl_origins_are_one_based_lines_and_skip_blank_lines(write_jsonl):
    path = write_jsonl("a.jsonl", [chat(("user", "a"), ("assistant", "b")), "", "   ", "[1, 2]", "{oops"])
    rows = list(read_rows(path))
    assert [(str(r.origin), r.parse_error is None) for r in rows] == [
        (f"{path}:1", True), (f"{path}:4", False), (f"{path}:5", False)]
    assert "expected a JSON object" in rows[1].parse_error
    assert "invalid JSON" in rows[2].parse_error
    assert rows[0].data["messages"][1]["content"] == "b"


def test_parquet_rows_use_row_index(tmp_path):
    rows = [chat(("user", f"q{i}"), ("assistant", f"a{i}"), group=f"g{i}") for i in range(3)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    read = list(read_rows(path))
    assert [r.origin.line for r in read] == [0, 1, 2]
    assert [r.data["group"] for r in read] == ["g0", "g1", "g2"]
    assert read[2].data["messages"][0] == {"role": "user", "content": "q2"}


def test_hf_datasets_directories(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [chat(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(4)]
    single = tmp_path / "single"
    datasets.Dataset.from_list(rows).save_to_disk(str(single))
    read = list(read_rows(single))
    assert [r.origin.line for r in read] == [0, 1, 2, 3]
    assert read[3].data["messages"][1]["content"] == "a3"

    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "test": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(both))
    origins = {str(r.origin) for r in read_rows(both)}
    assert f"{both}[test]:0" in origins and f"{both}[train]:2" in origins


def test_directory_of_files_is_read_in_sorted_order(tmp_path, write_jsonl):
    write_jsonl("b.jsonl", [chat(("user", "2"), ("assistant", "2"))])
    write_jsonl("a.jsonl", [chat(("user", "1"), ("assistant", "1"))])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [p.name for p in expand_inputs([tmp_path])] == ["a.jsonl", "b.jsonl"]
    assert [r.data["messages"][0]["content"] for r in read_rows(tmp_path)] == ["1", "2"]


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        list(read_rows(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        list(read_rows(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .jsonl or .parquet"):
        list(read_rows(tmp_path / "empty"))


def test_hashes_follow_content(tmp_path, write_jsonl):
    a = write_jsonl("a.jsonl", [chat(("user", "x"), ("assistant", "y"))])
    before_file, before_all = file_sha256(a), inputs_sha256([a])
    assert file_sha256(tmp_path) != before_file  # directories hash names + contents
    a.write_text(json.dumps(chat(("user", "x"), ("assistant", "z"))) + "\n")
    assert file_sha256(a) != before_file and inputs_sha256([a]) != before_all


def test_parquet_round_trip_of_tool_calling_rows_normalizes_to_the_original(tmp_path):
    from glmtune.data.contract import check_or_raise
    from glmtune.data.synthetic import generate_rows

    rows = generate_rows(60, seed=8)
    stored = json.loads(json.dumps(rows))
    for row in stored:  # Arrow needs one type per column: store arguments as JSON strings
        for message in row["messages"]:
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    path = tmp_path / "synth.parquet"
    pq.write_table(pa.Table.from_pylist(stored), path)
    normalized = [row.data for row in check_or_raise(read_rows(path))]
    assert normalized == rows


def test_check_format_names_the_mismatching_file(tmp_path):
    from glmtune.data.sources import check_format

    data = tmp_path / "rows.jsonl"
    data.write_text('{"messages": []}\n')
    check_format([data], "auto")
    check_format([data], "jsonl")
    with pytest.raises(ValueError, match=r"rows.jsonl: data.format is 'parquet' but this input is jsonl"):
        check_format([data], "parquet")
