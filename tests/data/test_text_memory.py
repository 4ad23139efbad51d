"""The raw-text pass streams: building a corpus ten times larger costs the process far less memory
than holding its tokens would (docs/data.md "Raw text": measured 290 MiB at 27 KB, 321 MiB at 100 MB)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.text_corpus_memory import write_corpus
from tests.peak_rss import PEAK, peak_rss


def _corpus(path: Path, megabytes: float) -> Path:
    write_corpus(path, megabytes)  # the memory table's documents (benchmarks/text_corpus_memory.py)
    return path


def _peak(corpus: Path, cache: Path) -> int:
    return peak_rss(f"from glmtune.data.text_corpus import TextCorpusOptions, build_text_corpus\n"
                    f"from glmtune.data.text_sources import TextReadOptions\n"
                    f"c = build_text_corpus([{str(corpus)!r}], TextCorpusOptions(read=TextReadOptions("
                    f"source_field='source')), tokenizer_dir=None, cache_dir={str(cache)!r})\n"
                    f"assert c.report['input']['tokens'] > 0\n{PEAK}")


def test_corpus_ten_times_larger_costs_little_memory(tmp_path: Path) -> None:
    """4 MB of text is about 1.5 M tokens: held as Python lists they cost 48 MiB more (measured with the
    documents kept in a list); the streaming pass grows 6 MiB (the per-document digests, the allocator)."""
    small = _peak(_corpus(tmp_path / "small.jsonl", 0.4), tmp_path / "cache")
    large = _peak(_corpus(tmp_path / "large.jsonl", 4), tmp_path / "cache")
    assert large - small < 20 << 20, (large >> 20, small >> 20)
