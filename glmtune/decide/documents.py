"""The user's documents (`--docs DIR`) as chunks with stated sizes, for the retrieval arm.

What is read: every `.txt`, `.md` and `.jsonl` file under DIR (recursively, in sorted path
order; names starting with `.` are skipped, and so is any other suffix: counted and named in the
report). A `.txt` or `.md` file is one document; each line of a `.jsonl` file is one document, a
JSON object whose `text` field (a string) is its text (other fields are ignored).

How a document is chunked (`chunk_words` W, `overlap` O; defaults 120 and 20 words):
  * paragraphs are runs of non-blank lines (a blank line ends one); words are what
    `str.split()` splits;
  * paragraphs are packed in order into a chunk while it holds at most W words; the next
    paragraph that would pass W starts a new chunk;
  * a paragraph of more than W words is cut into windows of W words, one starting every W - O
    words (the last ends at the paragraph's end), each a chunk of its own;
  * a chunk never spans two documents; its text is its words joined by single spaces, and it
    records its file and first and last line (of a `.jsonl` document: its line).

Bounds, each refused in one sentence before a chunk is made: a DIR that is missing, not a
directory, or holds no such file; documents of more than MAX_DOCS_BYTES together (sizes from
`stat`, so a 2 GB file is refused without being read); a file that is not UTF-8 text (a NUL byte
or an invalid sequence: a binary file named `.txt`), a FIFO or a device; a `.jsonl` line that is
not an object with a string `text`. Files are read a line at a time, so memory holds the chunks
made so far and one paragraph.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from glmtune.io.regular import kind_of, open_regular
from glmtune.io.text_limits import clipped, parse_json

SUFFIXES = (".txt", ".md", ".jsonl")
MAX_DOCS_BYTES = 32 << 20  # the text decide indexes in memory (BM25 over ~5M words)
MAX_JSONL_LINE_BYTES = 16 << 20
DEFAULT_CHUNK_WORDS, DEFAULT_OVERLAP = 120, 20
MIN_CHUNK_WORDS, MAX_CHUNK_WORDS = 8, 4096


@dataclass(frozen=True)
class Chunk:
    source: str  # the file, relative to the documents directory
    first_line: int
    last_line: int
    text: str

    @property
    def where(self) -> str:
        lines = str(self.first_line) if self.first_line == self.last_line else f"{self.first_line}-{self.last_line}"
        return f"{self.source}:{lines}"


@dataclass
class Corpus:
    root: Path
    chunk_words: int
    overlap: int
    chunks: list[Chunk] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # read, relative to root
    skipped: list[str] = field(default_factory=list)  # other suffixes, relative to root
    bytes: int = 0

    def describe(self) -> dict:
        return {"dir": str(self.root), "files": len(self.files), "bytes": self.bytes, "chunks": len(self.chunks),
                "chunk_words": self.chunk_words, "overlap_words": self.overlap,
                "skipped_files": len(self.skipped), "skipped_first": self.skipped[:10]}


@dataclass
class _Paragraph:
    words: list[str]
    line_starts: list[int]  # index of the first word of each line with words
    lines: list[int]  # those lines' numbers

    def line_of(self, word: int) -> int:
        return self.lines[bisect.bisect_right(self.line_starts, word) - 1]


def check_chunking(chunk_words: int, overlap: int) -> None:
    """ValueError naming the option for sizes out of range."""
    if not MIN_CHUNK_WORDS <= chunk_words <= MAX_CHUNK_WORDS:
        raise ValueError(f"--chunk-words {chunk_words}: expected {MIN_CHUNK_WORDS} to {MAX_CHUNK_WORDS} words")
    if not 0 <= overlap <= chunk_words // 2:
        raise ValueError(f"--chunk-overlap {overlap}: expected 0 to half of --chunk-words ({chunk_words // 2})")


def chunks_of(paragraphs, chunk_words: int, overlap: int) -> Iterator[tuple[int, int, list[str]]]:
    """(first line, last line, words) of each chunk of one document, from its `_Paragraph`s in order
    (the packing and windows of the module docstring)."""
    current: list[str] = []
    first = last = 0
    for paragraph in paragraphs:
        words = paragraph.words
        if len(words) > chunk_words:
            if current:
                yield first, last, current
                current = []
            for i in range(0, len(words), chunk_words - overlap):
                window = words[i:i + chunk_words]
                yield paragraph.line_of(i), paragraph.line_of(i + len(window) - 1), window
                if i + chunk_words >= len(words):
                    break
            continue
        if current and len(current) + len(words) > chunk_words:
            yield first, last, current
            current = []
        if not current:
            first = paragraph.lines[0]
        current = current + words
        last = paragraph.lines[-1]
    if current:
        yield first, last, current


def _text_lines(path: Path, rel: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file, a line at a time; ValueError at a binary line."""
    with open_regular(path, "--docs file") as fh:
        for number, raw in enumerate(fh, start=1):
            if b"\0" in raw:
                raise ValueError(f"--docs {rel}:{number}: a NUL byte: not a text file (a binary file?); decide reads "
                                 "UTF-8 .txt, .md and .jsonl documents")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"--docs {rel}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start}; a binary "
                                 "file?); decide reads UTF-8 .txt, .md and .jsonl documents") from None


def _paragraphs(lines: Iterator[tuple[int, str]]) -> Iterator[_Paragraph]:
    current = _Paragraph([], [], [])
    for number, line in lines:
        words = line.split()
        if not words:
            if current.words:
                yield current
                current = _Paragraph([], [], [])
            continue
        current.line_starts.append(len(current.words))
        current.lines.append(number)
        current.words.extend(words)
    if current.words:
        yield current


def _jsonl_documents(path: Path, rel: str) -> Iterator[Iterator[_Paragraph]]:
    """Each line's `text` as one document's paragraphs (every paragraph on the line's number)."""
    for number, line in _text_lines(path, rel):
        if not line.strip():
            continue
        where = f"--docs {rel}:{number}"
        if len(line) > MAX_JSONL_LINE_BYTES:
            raise ValueError(f"{where}: a line of {len(line):,} characters, more than {MAX_JSONL_LINE_BYTES:,}")
        value = parse_json(line, where)
        if not isinstance(value, dict) or not isinstance(value.get("text"), str):
            raise ValueError(f"{where}: not a JSON object with a string text field (a .jsonl document is "
                             f"{{\"text\": \"...\"}}), got {clipped(line, 80)}")
        yield _paragraphs((number, part) for part in value["text"].split("\n"))


def _files(root: Path) -> tuple[list[Path], list[str]]:
    """(the documents to read, the other files skipped), sorted, hidden names left out."""
    found, skipped = [], []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = Path(directory) / name
            if path.suffix.lower() not in SUFFIXES:
                skipped.append(str(path.relative_to(root)))
                continue
            if (kind := kind_of(path)) is not None:
                raise ValueError(f"--docs {path.relative_to(root)} is {kind}, not a document file; decide reads "
                                 "regular .txt, .md and .jsonl files")
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).parts), sorted(skipped)


def read_documents(root: str | Path, chunk_words: int = DEFAULT_CHUNK_WORDS, overlap: int = DEFAULT_OVERLAP,
                   max_bytes: int = MAX_DOCS_BYTES) -> Corpus:
    """Every document under `root` chunked (module docstring); ValueError in one sentence when
    there is nothing to read, too much, or a file that is not text."""
    check_chunking(chunk_words, overlap)
    root = Path(root)
    if not root.exists():
        raise ValueError(f"--docs {root}: no such directory")
    if not root.is_dir():
        raise ValueError(f"--docs {root}: not a directory (give the folder holding the .txt, .md and .jsonl "
                         "documents)")
    files, skipped = _files(root)
    if not files:
        others = f" ({len(skipped)} other files skipped: {', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})"
        raise ValueError(f"--docs {root}: no .txt, .md or .jsonl document in it{others if skipped else ''}")
    sizes = {path: path.stat().st_size for path in files}
    total = sum(sizes.values())
    if total > max_bytes:
        largest = max(files, key=sizes.get)
        raise ValueError(f"--docs {root}: {total:,} bytes of documents ({largest.relative_to(root)}: "
                         f"{sizes[largest]:,}), more than the {max_bytes:,} decide indexes in memory "
                         "(MAX_DOCS_BYTES); give the documents the suite's questions need")
    corpus = Corpus(root, chunk_words, overlap, skipped=skipped, bytes=total)
    for path in files:
        rel = str(path.relative_to(root))
        corpus.files.append(rel)
        documents = (_jsonl_documents(path, rel) if path.suffix.lower() == ".jsonl"
                     else iter([_paragraphs(_text_lines(path, rel))]))
        for paragraphs in documents:
            for first, last, words in chunks_of(paragraphs, chunk_words, overlap):
                corpus.chunks.append(Chunk(rel, first, last, " ".join(words)))
    if not corpus.chunks:
        raise ValueError(f"--docs {root}: its {len(files)} document file(s) hold no text (only blank lines)")
    return corpus
