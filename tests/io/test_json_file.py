"""The shared readers of JSON files and of names read from them: every hostile variant is one
ValueError starting with the file (and line), never a RecursionError, a TypeError or a read
without end; a name from a file never leads out of its directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glmtune.io.contained import inside
from glmtune.io.json_file import json_lines, read_json_file

DEEP = b"[" * 70 + b"]" * 70  # past the depth bound (64), within the size bounds here

FILES = {  # content -> what the sentence says
    "truncated": (b'{"a": [1, 2', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "not UTF-8": (b'{"a": "\xff"}', "not valid JSON"),
    "nested deep": (DEEP, "nested deeper than 64 levels"),
    "a list": (b"[1]", "is a list, not an object"),
    "a string": (b'"x"', "is a string, not an object"),
    "null": (b"null", "is null, not an object"),
    "over the bound": (b'{"a": "' + b"x" * 2000 + b'"}', "more than 1,000 bytes"),
}


@pytest.mark.parametrize("case", list(FILES))
def test_read_json_file_refuses_in_one_sentence_naming_the_file(tmp_path, case):
    content, said = FILES[case]
    path = tmp_path / "record.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        read_json_file(path, "run record", max_bytes=1000)
    message = str(refused.value)
    assert message.startswith(f"run record {path}: ") and said in message and "\n" not in message


def test_read_json_file_refuses_a_fifo_before_opening_it(tmp_path):
    os.mkfifo(tmp_path / "record.json")
    with pytest.raises(ValueError, match=r"record.json is a FIFO \(named pipe\), not a regular file"):
        read_json_file(tmp_path / "record.json", "run record")


def test_json_nested_past_the_recursion_limit_is_one_sentence(tmp_path):
    (tmp_path / "deep.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.json: JSON nested deeper than 64 levels"):
        read_json_file(tmp_path / "deep.json", kind=None)
    (tmp_path / "deep.jsonl").write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n")
    with pytest.raises(ValueError, match=r"deep.jsonl:1: JSON nested deeper than 64 levels"):
        list(json_lines(tmp_path / "deep.jsonl", kind=None))


def test_read_json_file_reads_what_glmtune_writes(tmp_path):
    (tmp_path / "a.json").write_text('{"step": 3, "names": ["x"]}')
    assert read_json_file(tmp_path / "a.json") == {"step": 3, "names": ["x"]}
    assert read_json_file(tmp_path / "a.json", kind=None) == {"step": 3, "names": ["x"]}


LINES = {  # file content -> (line, what the sentence says)
    "garbage mid-file": (b'{"step": 1}\nnot json\n{"step": 2}\n', 2, "not valid JSON"),
    "a list line": (b'{"step": 1}\n[1]\n', 2, "is a list, not an object"),
    "nested deep": (b'{"step": 1}\n' + DEEP + b"\n", 2, "nested deeper than 64 levels"),
    "not UTF-8": (b'{"step": "\xff"}\n', 1, "not valid JSON"),
    "a line over the bound": (b'{"step": "' + b"x" * 300 + b'"}\n', 1, "a line of more than 200 bytes"),
    "a cut line without its newline, mid-file": (b'{"step": 1}\n{"ste\n{"step": 2}\n', 2, "not valid JSON"),
}


@pytest.mark.parametrize("case", list(LINES))
def test_json_lines_refuses_a_hostile_line_naming_file_and_line(tmp_path, case):
    content, line, said = LINES[case]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        list(json_lines(path, "metrics file", max_line_bytes=200, cut_tail=True))
    message = str(refused.value)
    assert message.startswith(f"metrics file {path}:{line}: ") and said in message


def test_json_lines_drops_only_a_last_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert [(n, v) for n, v, _ in json_lines(path, cut_tail=True)] == [(1, {"step": 1}), (3, {"step": 2})]
    with pytest.raises(ValueError, match=r"metrics.jsonl:4: not valid JSON"):
        list(json_lines(path))
    path.write_bytes(b'{"step": 1}\n{"step": 2}')  # complete, only its newline missing
    assert [v["step"] for _, v, _ in json_lines(path, cut_tail=True)] == [1, 2]


NAMES = {  # name (or a link planted under it) -> what the sentence says
    "../../etc/passwd": "leaves",
    "/etc/passwd": "is an absolute path",
    "..": "leaves",
    "": "is not a file name",
    "sub/x.jsonl": "is not a plain file name",
    "a\\b": "is not a file name",
    "nul\0": "is not a file name",
    7: "is not a file name",
    None: "is not a file name",
}


@pytest.mark.parametrize("name", list(NAMES), ids=[repr(n) for n in NAMES])
def test_a_name_read_from_a_file_stays_in_its_directory(tmp_path, name):
    with pytest.raises(ValueError) as refused:
        inside(tmp_path, name, "manifest.json: outputs.train.file")
    assert str(refused.value).startswith("manifest.json: outputs.train.file names ")
    assert NAMES[name] in str(refused.value)


def test_a_link_out_of_the_directory_or_to_a_fifo_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "secret").write_text("x")
    (tmp_path / "d" / "train.jsonl").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match="is a link that leads out of"):
        inside(tmp_path / "d", "train.jsonl", "manifest")
    os.mkfifo(tmp_path / "d" / "pipe.jsonl")
    with pytest.raises(ValueError, match="is not a regular file"):
        inside(tmp_path / "d", "pipe.jsonl", "manifest")
    (tmp_path / "d" / "ok.jsonl").write_text("{}")
    assert inside(tmp_path / "d", "ok.jsonl", "manifest") == tmp_path / "d" / "ok.jsonl"
    assert inside(tmp_path / "d", "sub/ok.jsonl", "manifest", plain=False) == Path(tmp_path / "d" / "sub/ok.jsonl")
