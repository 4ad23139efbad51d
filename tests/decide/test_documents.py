"""`--docs DIR` read and chunked (glmtune/decide/documents.py): exact chunk boundaries and line
ranges, .jsonl documents, and one sentence for each folder or file decide cannot use (missing,
empty, binary, a FIFO, a 2 GB document refused from its size without being read)."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from glmtune.decide.documents import MAX_DOCS_BYTES, read_documents


def _write(path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def _words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def test_paragraphs_pack_and_long_ones_are_windowed(tmp_path):
    # line 1-2: 5 words; line 4: 4 words; lines 6-7: 20 + 2 words (one paragraph over the size)
    text = f"a b c\nd e\n\nf g h i\n\n{_words('w', 20)}\nx y\n"
    _write(tmp_path / "docs" / "one.md", text)
    corpus = read_documents(tmp_path / "docs", chunk_words=8, overlap=2)
    w = [f"w{i}" for i in range(20)] + ["x", "y"]
    assert [(c.where, c.text.split()) for c in corpus.chunks] == [
        ("one.md:1-2", list("abcde")),          # the next paragraph would make 9 > 8 words
        ("one.md:4", list("fghi")),             # flushed before the long paragraph
        ("one.md:6", w[0:8]),                   # windows of 8 words starting every 8 - 2
        ("one.md:6", w[6:14]),
        ("one.md:6", w[12:20]),
        ("one.md:6-7", w[18:22]),               # the last window ends at the paragraph's end
    ]
    assert corpus.describe()["chunks"] == 6 and corpus.files == ["one.md"]


def test_small_paragraphs_share_a_chunk_and_files_keep_apart(tmp_path):
    _write(tmp_path / "d" / "b.txt", "one two\n\nthree\n")
    _write(tmp_path / "d" / "a" / "c.txt", "four five six\n")
    corpus = read_documents(tmp_path / "d", chunk_words=8, overlap=0)
    assert [(c.where, c.text) for c in corpus.chunks] == [("a/c.txt:1", "four five six"), ("b.txt:1-3", "one two three")]


def test_jsonl_documents_are_lines_with_a_text_field(tmp_path):
    rows = [{"id": "x", "text": "PayFlow support line\n\nis open"}, {"text": _words("v", 10)}]
    _write(tmp_path / "d" / "kb.jsonl", json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    corpus = read_documents(tmp_path / "d", chunk_words=8, overlap=0)
    assert [(c.where, c.text) for c in corpus.chunks] == [
        ("kb.jsonl:1", "PayFlow support line is open"), ("kb.jsonl:3", _words("v", 8)), ("kb.jsonl:3", "v8 v9")]


def test_other_files_are_skipped_and_named(tmp_path):
    _write(tmp_path / "d" / "notes.md", "hello world\n")
    _write(tmp_path / "d" / "logo.png", b"\x89PNG\0\0")
    _write(tmp_path / "d" / ".git" / "HEAD", "ref\n")
    corpus = read_documents(tmp_path / "d")
    assert corpus.files == ["notes.md"] and corpus.skipped == ["logo.png"]


@pytest.mark.parametrize("case, message", [
    ("missing", "--docs {d}: no such directory"),
    ("file", "--docs {d}: not a directory"),
    ("empty", "--docs {d}: no .txt, .md or .jsonl document in it"),
    ("pictures", "--docs {d}: no .txt, .md or .jsonl document in it (1 other files skipped: a.png)"),
    ("blank", "--docs {d}: its 1 document file(s) hold no text"),
    ("nul", "--docs x.txt:2: a NUL byte: not a text file (a binary file?)"),
    ("latin1", "--docs x.md:1: not UTF-8 text (invalid continuation byte at byte 3; a binary file?)"),
    ("jsonl", "--docs x.jsonl:1: not a JSON object with a string text field"),
    ("fifo", "--docs x.txt is a FIFO (named pipe), not a document file"),
])
def test_what_cannot_be_read_is_one_sentence(tmp_path, case, message):
    d = tmp_path / "d"
    if case == "file":
        _write(d, "text")
    elif case != "missing":
        d.mkdir()
    if case == "pictures":
        _write(d / "a.png", b"\x89PNG")
    content = {"blank": ("x.txt", "\n \n"), "nul": ("x.txt", b"ok\nbin\0ary\n"), "latin1": ("x.md", b"caf\xe9\n"),
               "jsonl": ("x.jsonl", '["text"]\n')}.get(case)
    if content:
        _write(d / content[0], content[1])
    if case == "fifo":
        os.mkfifo(d / "x.txt")  # opened, it would wait for a writer forever
    with pytest.raises(ValueError) as err:
        read_documents(d)
    assert str(err.value).startswith(message.format(d=d)) and "\n" not in str(err.value)


def test_a_2_gb_document_is_refused_from_its_size_without_being_read(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    _write(d / "small.md", "a few words\n")
    with open(d / "huge.txt", "wb") as fh:
        fh.truncate(2 << 30)  # sparse: 2 GiB of NUL bytes that take no disk
    tracemalloc.start()
    with pytest.raises(ValueError) as err:
        read_documents(d)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(err.value) == (f"--docs {d}: 2,147,483,660 bytes of documents (huge.txt: 2,147,483,648), more than the "
                              f"{MAX_DOCS_BYTES:,} decide indexes in memory (MAX_DOCS_BYTES); give the documents the "
                              "suite's questions need")
    assert peak < 1 << 20, peak  # nothing of the file was read


@pytest.mark.parametrize("words, overlap, message", [(4, 0, "--chunk-words 4: expected 8 to 4096 words"),
                                                      (16, 9, "--chunk-overlap 9: expected 0 to half of --chunk-words (8)")])
def test_chunk_sizes_out_of_range_are_refused(tmp_path, words, overlap, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        read_documents(tmp_path, chunk_words=words, overlap=overlap)
