"""The contract for raw text (glmtune/data/text_contract.py) through the corpus builder: each rule
removes what it should and the report counts documents and tokens; sources never straddle splits;
the cache hit gives the same report; an empty corpus is one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.data.pii import scan_text
from glmtune.data.split import assign_split
from glmtune.data.text_corpus import TextCorpusOptions, build_text_corpus, load_split
from glmtune.data.text_sources import TextReadOptions

KEY = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2"  # an API key shape pii.py flags (built so no scanner flags this file)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


@pytest.fixture
def rows() -> list[dict]:
    return [
        {"text": "The pump must be serviced every six months.", "source": "manual-1"},
        {"text": "Hi", "source": "manual-1"},  # too short (min 3 tokens)
        {"text": "The pump must be serviced every six months.", "source": "manual-2"},  # exact duplicate
        {"text": "the PUMP must be serviced, every six months", "source": "manual-3"},  # near duplicate
        {"text": f"Use the key {KEY} to open the service portal.", "source": "manual-4"},  # PII
        {"text": "word " * 80, "source": "manual-5"},  # too long (max 60 tokens)
        {"text": "Replace the filter at every service visit.", "source": "manual-6"},
    ]


def _build(tmp_path: Path, rows: list[dict], **options):
    path = _write(tmp_path / "docs.jsonl", rows)
    defaults = dict(read=TextReadOptions(source_field="source"), min_tokens=3, max_tokens=60, pii_action="drop",
                    ratios=(1.0, 0.0, 0.0))
    return build_text_corpus([path], TextCorpusOptions(**{**defaults, **options}), tokenizer_dir=None,
                             cache_dir=tmp_path / "cache")


def test_each_rule_counts_documents_and_tokens(tmp_path: Path, rows, tiny_tokenizer) -> None:
    corpus = _build(tmp_path, rows)
    report, n = corpus.report, [_ntok(tiny_tokenizer, row["text"]) for row in rows]
    assert report["input"] == {"documents": 7, "tokens": sum(n)}
    assert report["removed"] == {"too_short": {"documents": 1, "tokens": n[1]},
                                 "too_long": {"documents": 1, "tokens": n[5]},
                                 "pii": {"documents": 1, "tokens": n[4]},
                                 "exact_duplicate": {"documents": 1, "tokens": n[2]},
                                 "near_duplicate": {"documents": 1, "tokens": n[3]}}
    assert report["splits"]["train"] == {"documents": 2, "tokens": n[0] + n[6], "sources": 2}
    kept = load_split(corpus, "train", len(tiny_tokenizer), tmp_path / "cache")
    assert [tiny_tokenizer.decode(d.input_ids[:-1]) for d in kept] == [rows[0]["text"], rows[6]["text"]]
    finding = corpus.pii_report["findings"][0]
    assert (finding["line"], finding["field"], finding["kind"]) == (5, "text", "api_key")
    assert KEY not in json.dumps(corpus.pii_report)  # redacted


def test_pii_scan_keeps_no_document_alive(tmp_path: Path, rows) -> None:
    """pii.scan_text's cache (for chat rows) would hold up to 65,536 documents: the text scan bypasses it."""
    scan_text.cache_clear()
    _build(tmp_path, rows)
    assert scan_text.cache_info().currsize == 0


def test_pii_report_keeps_the_document(tmp_path: Path, rows) -> None:
    corpus = _build(tmp_path, rows, pii_action="report")
    assert corpus.report["removed"]["pii"]["documents"] == 0
    assert corpus.report["pii"] == {"action": "report", "documents_with_findings": 1, "findings": 1}
    assert corpus.report["splits"]["train"]["documents"] == 3


def test_cache_hit_gives_the_same_report_without_reading(tmp_path: Path, rows) -> None:
    first = _build(tmp_path, rows)
    second = _build(tmp_path, rows)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.report == first.report and second.keys == first.keys
    sidecar = first.entries["train"].with_suffix(".json")
    sidecar.write_text(json.dumps({"key": "planted"}))
    with pytest.raises(ValueError, match=r"\.json: not a text corpus sidecar glmtune writes"):
        _build(tmp_path, rows)
    changed = _build(tmp_path, rows, min_tokens=1)  # an option that changes what is kept: another entry
    assert not changed.cache_hit and changed.report["removed"]["too_short"]["documents"] == 0


def test_split_by_source_never_straddles(tmp_path: Path, tiny_tokenizer) -> None:
    rows = [{"text": f"Clause {i} of contract {i % 12}: the buyer pays within {i} days.", "source": f"c{i % 12}"}
            for i in range(120)]
    corpus = _build(tmp_path, rows, ratios=(0.5, 0.5, 0.0), seed=3, max_tokens=None)
    by_split = {name: [] for name in ("train", "validation")}
    for name in by_split:
        for document in load_split(corpus, name, len(tiny_tokenizer), tmp_path / "cache"):
            text = tiny_tokenizer.decode(document.input_ids[:-1])
            by_split[name].append(next(r["source"] for r in rows if r["text"] == text))
    assert by_split["train"] and by_split["validation"]
    assert not set(by_split["train"]) & set(by_split["validation"])
    assert all(assign_split(f"source:{s}", (0.5, 0.5, 0.0), 3) == name for name, sources in by_split.items()
               for s in sources)
    assert corpus.report["splits"]["train"]["sources"] + corpus.report["splits"]["validation"]["sources"] == 12


def test_sources_are_files_without_source_field(tmp_path: Path, tiny_tokenizer) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(10):
        (folder / f"doc{i}.txt").write_text(f"first part of file {i}\n\n===\n\nsecond part of file {i}\n")
    options = TextCorpusOptions(read=TextReadOptions(separator="==="), ratios=(0.5, 0.5, 0.0))
    corpus = build_text_corpus([folder], options, tokenizer_dir=None, cache_dir=tmp_path / "cache")
    assert corpus.report["input"]["documents"] == 20
    for name in ("train", "validation"):
        texts = [tiny_tokenizer.decode(d.input_ids[:-1]) for d in load_split(corpus, name, None, tmp_path / "cache")]
        files = {text.split()[-1] for text in texts}
        assert len(texts) == 2 * len(files)  # both parts of a file in the same split


def test_empty_corpus_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"^no documents in .*blank\.txt \(empty, or only whitespace\): nothing to "
                                         r"tokenize$"):
        build_text_corpus([tmp_path / "blank.txt"], TextCorpusOptions(), tokenizer_dir=None,
                          cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "tokenized").iterdir())  # no entry, no temporary file left
