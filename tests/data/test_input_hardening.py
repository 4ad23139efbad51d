"""Hostile data inputs: undecodable lines, files that are not what their name says,
empty datasets. Each is one sentence naming the file (and line), and a refused
command changes nothing on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_test_helpers import chat
from tests.tree_snapshot import changes, snapshot

from glmtune.cli import main
from glmtune.data.contract import check_or_raise
from glmtune.data.prepare import prepare_dataset
from glmtune.data.sources import read_rows

GOOD = chat(("user", "q"), ("assistant", "a"))


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def cli_error(capsys, argv: list[str]) -> str:
    """Run the real entry point, expect exit 2 and one stderr line; return its message."""
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    # The prefix names the command ("glmtune data" or, with the action, "glmtune data validate").
    match = re.fullmatch(r"glmtune data(?: \w+)?: error: (.*)", err[0])
    assert match, err[0]
    return match.group(1)


def test_invalid_utf8_is_one_bad_row_at_its_line(tmp_path):
    good = json.dumps(GOOD).encode()
    bad = b'{"messages": [{"role": "user", "content": "h\xc3\xa9llo \xff"}]}'
    surrogate = b'{"messages": [{"role": "user", "content": "\\udc80"}, {"role": "assistant", "content": "a"}]}'
    path = write_lines(tmp_path / "d.jsonl", [good, bad, b"   ", good, surrogate])
    rows = list(read_rows(path))
    assert [(r.origin.line, r.parse_error) for r in rows] == [
        (1, None),
        (2, "not valid UTF-8 (byte 0xff at column 50)"),  # characters, as JSON's columns: "é" is 2 bytes
        (4, None),
        (5, "not valid Unicode: lone surrogate \\udc80 escaped in a JSON string"),
    ]
    assert rows[2].data == GOOD


def test_validate_lists_an_invalid_utf8_line_and_still_checks_the_others(tmp_path, capsys):
    path = write_lines(tmp_path / "d.jsonl", [
        json.dumps(GOOD).encode(),
        b'{"messages": "\x80"}',
        json.dumps(chat(("user", "u"))).encode(),
        json.dumps(GOOD).encode(),
    ])
    assert main(["data", "validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:2: <row>: not valid UTF-8 (byte 0x80 at column 15)",
        f"{path}:3: messages[0].role: conversation must end with an assistant turn, not 'user'",
        "2 violation(s) in 2 of 4 row(s)",
    ]


def test_prepare_refuses_an_invalid_utf8_row_like_any_contract_violation(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), b"\xfe{}"])
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        prepare_dataset([path], tmp_path / "out")
    assert str(info.value) == ("1 data contract violation(s) (run `glmtune data validate` for all); "
                               f"the first: {path}:2: <row>: not valid UTF-8 (byte 0xfe at column 1)")
    assert changes(before, snapshot(tmp_path)) == []


def test_a_parquet_name_on_another_file_is_one_line_naming_it(tmp_path, capsys):
    fake = tmp_path / "x.parquet"
    fake.write_text(json.dumps(GOOD) + "\n")
    before = snapshot(tmp_path)
    assert cli_error(capsys, ["data", "validate", str(fake)]) == (
        f"{fake}: not a readable Parquet file (Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file.)")
    assert cli_error(capsys, ["data", "prepare", str(fake), "--out", str(tmp_path / "out")]).startswith(
        f"{fake}: not a readable Parquet file (")
    assert changes(before, snapshot(tmp_path)) == []


def test_a_parquet_file_damaged_inside_is_one_line_naming_it(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [chat(("user", f"question {i}"), ("assistant", f"answer {i}")) for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=500)
    data = bytearray(path.read_bytes())
    data[2000:6000] = bytes(b ^ 0x5A for b in data[2000:6000])  # footer intact, pages garbage
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as info:
        list(read_rows(path))
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable Parquet file (") and message.endswith(")")
    assert "\n" not in message and message.isprintable()


def test_a_damaged_datasets_directory_is_one_line_naming_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.Dataset.from_list([GOOD]).save_to_disk(str(path))
    (path / "state.json").write_text("{bad")
    with pytest.raises(ValueError) as info:
        list(read_rows(path))
    assert str(info.value) == (f"{path}: not a readable `datasets` directory (JSONDecodeError: Expecting property "
                               "name enclosed in double quotes: line 1 column 2 (char 1))")


def test_empty_dataset_is_refused_by_validate(tmp_path, capsys):
    empty = write_lines(tmp_path / "empty.jsonl", [])
    blank = write_lines(tmp_path / "blank.jsonl", [b"", b"  \t", b"\r"])
    before = snapshot(tmp_path)
    assert cli_error(capsys, ["data", "validate", str(empty), str(blank)]) == (
        f"no rows in {empty}, {blank} (empty, or only blank lines): nothing to validate")
    assert changes(before, snapshot(tmp_path)) == []


def test_empty_dataset_is_refused_by_prepare_before_any_output(tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    write_lines(inputs / "a.jsonl", [b""])
    pq.write_table(pa.Table.from_pylist([GOOD]).slice(0, 0), inputs / "b.parquet")  # a real Parquet file, 0 rows
    before = snapshot(tmp_path)
    assert cli_error(capsys, ["data", "prepare", str(inputs), "--out", str(tmp_path / "out")]) == (
        f"no rows in {inputs} (empty, or only blank lines): nothing to prepare")
    assert changes(before, snapshot(tmp_path)) == []


def test_valid_rows_still_pass_the_contract_after_byte_reading(tmp_path):
    # Non-ASCII text, a CRLF line end and a U+2028 inside a string must survive reading as bytes.
    row = chat(("user", "naïve — 東京\u2028?"), ("assistant", "ok"))
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(row, ensure_ascii=False).encode() + b"\r"])
    assert [r.data for r in check_or_raise(read_rows(path))] == [row]
