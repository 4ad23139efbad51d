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
    assert str(info.value) == (f"`datasets` state {path / 'state.json'}: not valid JSON (Expecting property "
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


# --------------------------------------------------------------------------- nesting and size

DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in json.loads, before the bound


def _tool_row(arguments: object) -> dict:
    """A row with a declared tool, whose JSON Schema and call arguments nest like real ones."""
    schema = {"type": "object", "properties": {"filter": {"type": "object", "properties": {
        "range": {"type": "object", "properties": {"from": {"type": "array", "items": {"type": "string"}}}}}}}}
    return {"tools": [{"type": "function", "function": {"name": "search", "parameters": schema}}],
            "messages": [{"role": "user", "content": "find it"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "search", "arguments": arguments}}]},
                         {"role": "tool", "content": "[]"},
                         {"role": "assistant", "content": "nothing found"}]}


def test_real_rows_with_tools_and_nested_arguments_fit_the_depth_bound(tmp_path):
    arguments = {"filter": {"range": {"from": [["2024-01", "2024-02"]]}}}
    rows = [_tool_row(arguments), _tool_row(json.dumps(arguments))]  # arguments as an object and as a JSON string
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r).encode() for r in rows])
    normalized = check_or_raise(read_rows(path))
    assert [r.data["messages"][1]["tool_calls"][0]["function"]["arguments"] for r in normalized] == [arguments] * 2


def test_a_row_nested_thousands_deep_is_one_violation_and_the_others_are_checked(tmp_path, capsys):
    path = write_lines(tmp_path / "d.jsonl", [
        json.dumps(GOOD).encode(),
        ('{"messages": ' + DEEP + "}").encode(),
        ('{"messages": [{"role": "user", "content": "q"}], "extra": ' + "[" * 65 + "]" * 65 + "}").encode(),
        json.dumps(chat(("user", "u"))).encode(),
    ])
    assert main(["data", "validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:2: <row>: JSON nested deeper than 64 levels",
        f"{path}:3: <row>: JSON nested deeper than 64 levels",  # 66 levels: under the recursion limit, over ours
        f"{path}:4: messages[0].role: conversation must end with an assistant turn, not 'user'",
        "3 violation(s) in 3 of 4 row(s)",
    ]


def test_prepare_refuses_a_deep_row_like_any_contract_violation(tmp_path, capsys):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD).encode(), DEEP.encode()])
    before = snapshot(tmp_path)
    assert cli_error(capsys, ["data", "prepare", str(path), "--out", str(tmp_path / "out")]) == (
        "1 data contract violation(s) (run `glmtune data validate` for all); "
        f"the first: {path}:2: <row>: JSON nested deeper than 64 levels")
    assert changes(before, snapshot(tmp_path)) == []


def test_deep_tool_arguments_and_final_answers_are_violations_at_their_field(tmp_path):
    schema_path = tmp_path / "schema.json"
    schema_path.write_text('{"type": "object"}')
    answer = chat(("user", "q"), ("assistant", '{"a": ' + DEEP + "}"))
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(_tool_row(DEEP)).encode(), json.dumps(answer).encode()])
    from glmtune.data.contract import load_schema, validate_rows

    found = [str(v) for v in validate_rows(read_rows(path), load_schema(schema_path))]
    assert found == [
        f"{path}:1: messages[1].tool_calls[0].function.arguments: JSON string: JSON nested deeper than 64 levels",
        f"{path}:2: messages[1].content: final answer: JSON nested deeper than 64 levels",
    ]
    schema_path.write_text('{"properties": {"a": ' + DEEP + "}}")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(schema_path))}: JSON nested deeper than 64 levels$"):
        load_schema(schema_path)


def _row_of(size: int) -> bytes:
    """A valid row whose JSON is exactly `size` bytes."""
    base = len(json.dumps(chat(("user", ""), ("assistant", "a"))))
    return json.dumps(chat(("user", "y" * (size - base)), ("assistant", "a"))).encode()


def test_a_line_over_the_size_cap_is_one_bad_row_read_no_further(tmp_path, monkeypatch):
    from glmtune.data import sources

    monkeypatch.setattr(sources, "MAX_ROW_BYTES", 1000)  # 16 MiB in use; the reading is the same
    good = json.dumps(GOOD).encode()
    path = write_lines(tmp_path / "d.jsonl", [good, _row_of(5000), good, _row_of(1000), _row_of(1001)])
    path.write_bytes(path.read_bytes() + _row_of(1001))  # a last line without its newline, over the cap
    rows = list(read_rows(path))
    too_long = "line longer than 1,000 bytes (MAX_ROW_BYTES); one line holds one conversation"
    assert [(r.origin.line, r.parse_error) for r in rows] == [
        (1, None), (2, too_long), (3, None), (4, None), (5, too_long), (6, too_long)]
    assert rows[3].data == json.loads(_row_of(1000))  # exactly at the cap: read whole


def test_a_deep_parquet_row_is_one_bad_row(tmp_path):
    path = tmp_path / "d.parquet"
    value: object = "leaf"
    for _ in range(70):  # structs: Parquet's own schema limit (100 levels) counts a list twice
        value = {"a": value}
    pq.write_table(pa.Table.from_pylist([{**GOOD, "extra": value}, {**GOOD, "extra": None}]), path)
    rows = list(read_rows(path))
    assert [(r.origin.line, r.parse_error) for r in rows] == [(0, "nested deeper than 64 levels"), (1, None)]
