"""Raw-text readers (glmtune/data/text_sources.py): .txt/.md, JSONL, Parquet, and the bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glmtune.cli import main
from glmtune.data.text_sources import MAX_TEXT_LINE_BYTES, TextReadOptions, read_documents
from tests.peak_rss import PEAK


def _docs(paths, **options):
    return [(d.text, d.source, d.origin.line) for d in read_documents(paths, TextReadOptions(**options))]


def test_plain_files_one_document_per_file_and_folder_sources(tmp_path: Path) -> None:
    (tmp_path / "corpus" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "a.md").write_text("# Title\n\nBody <|user|> text.\n")
    (tmp_path / "corpus" / "b" / "c.txt").write_text("\n\nsecond file\n")
    (tmp_path / "corpus" / "notes.csv").write_text("ignored")
    (tmp_path / "corpus" / ".hidden.txt").write_text("ignored")
    (tmp_path / "corpus" / "blank.txt").write_text("  \n\n")
    assert _docs([tmp_path / "corpus"]) == [("# Title\n\nBody <|user|> text.", "a.md", 1),
                                             ("second file", "b/c.txt", 3)]


def test_separator_splits_a_file_even_across_lines(tmp_path: Path) -> None:
    path = tmp_path / "manual.txt"
    path.write_text("one\ntwo\n\n===\n\nthree\n===\nfour")
    assert _docs([path], separator="\n===\n") == [("one\ntwo", "manual.txt", 1), ("three", "manual.txt", 6),
                                                  ("four", "manual.txt", 8)]


def test_jsonl_named_field_and_source_field(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    rows = [{"body": "alpha", "family": "f1"}, {"body": "beta", "family": 7}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert _docs([path], text_field="body") == [("alpha", "docs.jsonl", 1), ("beta", "docs.jsonl", 2)]
    assert _docs([path], text_field="body", source_field="family") == [("alpha", "f1", 1), ("beta", "7", 2)]
    with pytest.raises(ValueError, match=r"docs\.jsonl:1: the text field 'text' is missing, not a string"):
        _docs([path])


def test_parquet_text_column_streamed_by_batches(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    texts = [f"document {i}" for i in range(600)]
    pq.write_table(pa.table({"content": texts, "family": [f"s{i % 3}" for i in range(600)]}), path,
                   row_group_size=100)
    docs = _docs([path], text_field="content", source_field="family")
    assert [d[0] for d in docs] == texts and docs[599] == ("document 599", "s2", 599)
    with pytest.raises(ValueError, match=r"docs\.parquet: no column 'text' \(columns: content, family\)"):
        _docs([path])


def test_binary_file_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "image.txt"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match=r"image\.txt: a binary file \(a NUL byte at offset 8\), not text"):
        _docs([path])
    late = tmp_path / "late.jsonl"  # a NUL past the first 8 KiB: the line that holds it
    late.write_bytes(b'{"text": "ok"}\n' * 1000 + b"\x00\n")
    with pytest.raises(ValueError, match=r"late\.jsonl:1001: a binary file \(a NUL byte on this line\), not text"):
        _docs([late])


def test_invalid_utf8_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "latin1.md"
    path.write_bytes("fine\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.md:2: not valid UTF-8 \(byte 0xe9 at column 4\)"):
        _docs([path])


def _peak_reading(path: Path, max_line_bytes: int) -> tuple[int, str]:
    """(peak RSS in a fresh interpreter, the refusal) of reading `path` with a line bound."""
    code = (f"from glmtune.data.text_sources import TextReadOptions, read_documents\n"
            f"try:\n    list(read_documents([{str(path)!r}], TextReadOptions(max_line_bytes={max_line_bytes})))\n"
            f"except ValueError as exc:\n    print('REFUSED', exc)\n{PEAK}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("PEAK")[-1]), done.stdout


def test_huge_single_line_refused_without_reading_it_whole(tmp_path: Path) -> None:
    """A 48 MB line without a newline, read with a 1 MB bound: refused naming the file and line, and
    the reader's peak memory is that of reading a small file (the line is never read whole; with a
    bound above the line it would be, and decoded: twice its size)."""
    huge, small = tmp_path / "one_line.txt", tmp_path / "small.txt"
    with huge.open("wb") as f:
        for _ in range(48):
            f.write(b"x" * (1 << 20))
    small.write_text("x" * (2 << 20))  # also over the bound: the same refusal, after reading 1 MB
    peak_huge, out = _peak_reading(huge, 1 << 20)
    assert f"REFUSED {huge}:1: a line longer than 1,048,576 bytes" in out
    peak_small, _ = _peak_reading(small, 1 << 20)
    assert peak_huge - peak_small < 16 << 20, (peak_huge, peak_small)


def test_document_bound(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("a line of text\n" * 1000)
    with pytest.raises(ValueError, match=r"book\.txt:1: a document longer than 4,096 bytes"):
        _docs([path], max_document_bytes=4096)


def test_jsonl_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object, got list"):
        _docs([path])
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        _docs([path])


def test_unsupported_inputs(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match=r"x\.csv: unsupported text file"):
        _docs([tmp_path / "x.csv"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty holds no \.txt, \.md, \.jsonl, \.parquet files"):
        _docs([tmp_path / "empty"])
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(ValueError, match=r"a\.txt: data.format is 'jsonl' but this input is not a \.jsonl file"):
        _docs([tmp_path / "a.txt"], file_format="jsonl")


def test_a_500_mb_single_line_is_one_sentence_naming_the_file(tmp_path: Path, capsys) -> None:
    """Issue 47's case at its size, through `glmtune plan` (which reads the corpus as `glmtune train`
    does): a 500 MB file with no newline is refused in one line naming the file and line 1, after
    reading no more than the 16 MiB bound. Past the bound the file is a hole (no disk spent: the
    refusal comes before the reader gets there)."""
    huge = tmp_path / "dump.txt"
    with huge.open("wb") as f:
        f.write(b"x" * (MAX_TEXT_LINE_BYTES + 4096))
        f.truncate(500 * 10**6)
    assert huge.stat().st_size == 500 * 10**6
    code = main(["plan", "recipes/tiny/cpt_domain_text.yaml", "--data.train", f"[{huge}]",
                 "--data.cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert f"{huge}:1: a line longer than 16,777,216 bytes; not a text file glmtune reads" in err
    tracemalloc.start()
    with pytest.raises(ValueError, match=r"dump\.txt:1: a line longer than"):
        _docs([huge])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * MAX_TEXT_LINE_BYTES + (4 << 20), peak  # the bound's read, not the 500 MB line
