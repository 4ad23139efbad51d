"""Domain perplexity: held-out domain documents scored as next-token loss, base against candidate.

Continued pretraining shifts a model toward a domain's text; this set measures the shift on
documents held out of training (by source, so no document family straddles the split), beside the
general-text regression (`general_text.py`) that measures what the shift cost.

    domain_text:
      path: heldout/         # .txt/.md, .jsonl or .parquet files, or a folder of them (data.kind: text's inputs)
      text_field: text       # JSONL key / Parquet column of a document (as data.text_field)
      text_separator: null   # .txt/.md: null = one document per file, else split on it (as data.text_separator)
      source_field: null     # the key / column naming a document's source, its category; null = its file
      window: 512            # tokens per forward
      limit: null            # the first N documents

Documents are read and tokenized by the continued-pretraining data path itself
(`data.text_sources.read_documents`, `data.text_corpus.tokenize_texts`): the text with no template
and no special tokens added (special-token text tokenized as its characters), then the tokenizer's
EOS, which training puts after every document. A document of more than `window` tokens (EOS
included) is scored in consecutive, non-overlapping windows of `window` tokens, each its own
forward, as `data.long_documents: split` with no overlap cuts it at the packed length: a window's
first token is context only (no attention across the cut). A 1-token tail predicts nothing and is
dropped. Every other token is predicted from the tokens before it in its window.

Per source: the summed loss and the number of predicted tokens; the loss of a category is its sum
over its count (nats per token), the perplexity exp(loss). Categories are "all" plus each source
when there are 2..MAX_SOURCE_CATEGORIES sources (more: "all" only). Windows are the same for
every model (one tokenizer: eval refuses two).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.data.text_corpus import tokenize_texts
from glmtune.data.text_sources import TextDocument, TextReadOptions, no_documents_message, read_documents
from glmtune.eval.aggregate import metric_record
from glmtune.eval.scorers.base import MetricDef

METRIC_PREFIX = "domain_text/loss"
DOMAIN_LOSS = MetricDef("loss", "mean next-token loss on the held-out domain documents", "nats_per_token", False)
DOMAIN_PERPLEXITY = MetricDef("perplexity", "exp of the held-out domain loss", "perplexity", False)
DOMAIN_METRICS = (DOMAIN_LOSS, DOMAIN_PERPLEXITY)
MAX_DOMAIN_DOCUMENTS = 100_000
MAX_SOURCE_CATEGORIES = 16  # beyond, a table of one row per source is longer than it is useful


@dataclass
class DomainTextConfig:
    path: str = ""  # files or a folder, as data.train of data.kind: text; relative to the suite file
    text_field: str = "text"
    text_separator: str | None = None
    source_field: str | None = None
    window: int = 512  # tokens per forward (non-overlapping windows of a long document)
    limit: int | None = None  # the first N documents


def load_documents(path: Path, config: DomainTextConfig) -> list[TextDocument]:
    """The set's documents in file order, its first `limit` (ValueError: one sentence naming the
    file, and line where there is one)."""
    options = TextReadOptions(text_field=config.text_field, separator=config.text_separator,
                              source_field=config.source_field)
    wanted = config.limit if config.limit is not None else MAX_DOMAIN_DOCUMENTS
    try:
        docs = list(itertools.islice(read_documents([path], options), wanted + 1))
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"domain_text: {exc}") from None
    if len(docs) > wanted and config.limit is None:
        raise ValueError(f"domain_text: {path}: more than {MAX_DOMAIN_DOCUMENTS:,} documents; give it a limit")
    if not docs:
        raise ValueError(f"domain_text: {no_documents_message([path])}")
    return docs[:wanted]


def document_windows(tokenizer, text: str, window: int) -> list[list[int]]:
    """A document's token windows: its tokens and EOS, cut every `window` tokens (a 1-token tail dropped)."""
    [ids] = tokenize_texts(tokenizer, [text])
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


def domain_windows(tokenizer, documents: list[TextDocument], window: int) -> dict[str, list[list[int]]]:
    """Source -> the windows of its documents, sources in first-seen order."""
    by_source: dict[str, list[list[int]]] = {}
    for doc in documents:
        by_source.setdefault(doc.source, []).extend(document_windows(tokenizer, doc.text, window))
    return by_source


def _values(sums: dict[str, list[float]] | None, sources: list[str]) -> tuple[float | None, int]:
    """(loss, predicted tokens) over `sources`; None when nothing was scored."""
    if not sums:
        return None, 0
    total = sum(sums[s][0] for s in sources)
    count = int(sum(sums[s][1] for s in sources))
    return (total / count if count else None), count


def _entry(values: dict[str, float | None], n: int, labels: list[str]) -> dict[str, Any]:
    """A category's values, n (predicted tokens) and each candidate's delta from the base."""
    base = values.get("base")
    delta = {label: values[label] - base if values[label] is not None and base is not None else None
             for label in labels[1:]}
    return {"n": n, "values": values, "delta": delta}


def domain_metric_records(results: dict[str, Any], labels: list[str]) -> list[dict]:
    """The scorecard's two domain metrics: loss and perplexity, by category ("all", each source);
    `results[label]["domain"]`: the model's per-source sums (`domain_loss.domain_losses`)."""
    sums = {label: results[label].get("domain") for label in labels}
    sources = list(next((s for s in sums.values() if s), {}) or {})
    groups = {"all": sources}
    if 2 <= len(sources) <= MAX_SOURCE_CATEGORIES:
        groups.update({source: [source] for source in sources})
    records = []
    for definition in DOMAIN_METRICS:
        by_category = {}
        for category, members in groups.items():
            values, n = {}, 0
            for label in labels:
                loss, count = _values(sums[label], members)
                values[label] = loss if definition is DOMAIN_LOSS or loss is None else math.exp(loss)
                n = max(n, count)
            by_category[category] = _entry(values, n, labels)
        records.append(metric_record(f"{METRIC_PREFIX}/{definition.name}", definition, by_category))
    return records


def suite_domain_windows(tokenizer, path: Path | None, config: DomainTextConfig | None
                         ) -> dict[str, list[list[int]]] | None:
    """The suite's domain windows by source (read and tokenized before any model loads); None without a set."""
    if path is None or config is None:
        return None
    return domain_windows(tokenizer, load_documents(path, config), config.window)
