"""On-disk cache of tokenized datasets.

Tokenizing a large dataset through the chat template is slow and every training
launch (and every rank) would repeat it, so results are stored as one `.npz` per
key (flat int32 `input_ids` and `labels` plus int64 `offsets`) with a small JSON
sidecar describing what went into the key. The key is the sha256 of
  * the tokenizer files (tokenizer.json, tokenizer_config.json, ...),
  * the chat template text,
  * the data files' contents,
  * the options that change labels: loss_on, enable_thinking,
  * the final-answer JSON Schema, if any (a hit skips validation, so it must have
    passed the same contract),
  * a format version, bumped whenever tokenization code changes its output,
  * for preference data, the kind "preference" (absent for chat data, whose keys
    predate it), so the same files never share an entry between SFT and DPO.
Preference data (`tokenize_preference_dataset`) is stored as its samples interleaved:
chosen of pair 0, rejected of pair 0, chosen of pair 1, ...
A hit therefore needs neither the tokenizer nor the data to be read: only hashed.
Writes go to a temporary file then `os.replace`, so concurrent writers (several
ranks) never expose a partial file; the last complete write wins.

Cache directory: the `cache_dir` argument, else $GLMTUNE_CACHE_DIR, else
$XDG_CACHE_HOME/glmtune, else ~/.cache/glmtune; entries live in `tokenized/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glmtune.data.chat_template import LOSS_ON_CHOICES, LossOn, TokenizedSample, load_chat_template, tokenize_row
from glmtune.data.contract import check_or_raise
from glmtune.data.preferences import check_preferences_or_raise, tokenize_pair
from glmtune.data.sources import inputs_sha256, read_rows
from glmtune.data.tokenizer import TOKENIZER_FILES, load_tokenizer, resolve_tokenizer_dir

# Bump when tokenization output changes for the same inputs (mask rules, eos handling).
CACHE_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    if os.environ.get("GLMTUNE_CACHE_DIR"):
        return Path(os.environ["GLMTUNE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glmtune"


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """sha256 over the tokenizer files present in a directory (names and contents).

    Only tokenizer files count, so a model directory's weights are never read.
    """
    digest = hashlib.sha256()
    directory = Path(tokenizer_dir)
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(*, tokenizer_hash: str, template: str, data_hash: str, loss_on: str, enable_thinking: bool,
              schema: dict[str, Any] | None = None, kind: str = "chat") -> str:
    """The cache key for one tokenized dataset (components in the module docstring)."""
    components = {
        "format": CACHE_FORMAT_VERSION,
        "tokenizer": tokenizer_hash,
        "template": hashlib.sha256(template.encode()).hexdigest(),
        "data": data_hash,
        "loss_on": loss_on,
        "enable_thinking": enable_thinking,
        "schema": None if schema is None else hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest(),
    }
    if kind != "chat":  # chat keys stay what they were before preference data existed
        components["kind"] = kind
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


class TokenizationCache:
    """`get`/`put` lists of TokenizedSample under `<cache_dir>/tokenized/<key>.npz`."""

    def __init__(self, cache_dir: str | Path | None = None):
        self.root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.directory = self.root / "tokenized"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.npz"

    def get(self, key: str) -> list[TokenizedSample] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        with np.load(path) as arrays:
            input_ids, labels, offsets = arrays["input_ids"], arrays["labels"], arrays["offsets"]
        return [TokenizedSample(input_ids[start:end].tolist(), labels[start:end].tolist())
                for start, end in zip(offsets[:-1], offsets[1:])]

    def put(self, key: str, samples: list[TokenizedSample], meta: dict[str, Any] | None = None) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(sample.input_ids) for sample in samples])
        arrays = {
            "input_ids": np.array([t for s in samples for t in s.input_ids], dtype=np.int32),
            "labels": np.array([t for s in samples for t in s.labels], dtype=np.int32),
            "offsets": offsets,
        }
        path = self.path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        sidecar = {"key": key, "num_samples": len(samples), "num_tokens": int(offsets[-1]), **(meta or {})}
        path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")
        return path


@dataclass
class TokenizedDataset:
    samples: list[TokenizedSample]
    key: str
    cache_hit: bool
    cache_path: Path | None


def tokenize_dataset(paths: str | Path | list[str | Path], *, tokenizer_dir: str | Path | None = None,
                     loss_on: LossOn = "all_assistant", enable_thinking: bool = True,
                     schema: dict[str, Any] | None = None, cache_dir: str | Path | None = None,
                     use_cache: bool = True) -> TokenizedDataset:
    """Tokenize data files with a tokenizer's chat template, through the cache.

    Args:
        paths: data files/directories (see sources.read_rows).
        tokenizer_dir: model or tokenizer directory; None for the bundled tiny tokenizer.
            Its own chat template is used, else the bundled GLM-5 template.
        loss_on, enable_thinking: see chat_template.tokenize_conversation.
        schema: optional final-answer JSON Schema enforced by the contract on a miss.
        cache_dir: cache root (default in module docstring).
        use_cache: False always tokenizes and writes nothing.
    """
    if loss_on not in LOSS_ON_CHOICES:
        raise ValueError(f"loss_on must be one of {LOSS_ON_CHOICES}, got {loss_on!r}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    template = load_chat_template(directory)
    key = cache_key(tokenizer_hash=tokenizer_sha256(directory), template=template, data_hash=inputs_sha256(paths),
                    loss_on=loss_on, enable_thinking=enable_thinking, schema=schema)
    cache = TokenizationCache(cache_dir)
    if use_cache and (samples := cache.get(key)) is not None:
        return TokenizedDataset(samples, key, cache_hit=True, cache_path=cache.path(key))
    tokenizer = load_tokenizer(directory)
    rows = check_or_raise(read_rows(paths), schema)
    samples = [tokenize_row(row.data, tokenizer, template=template, loss_on=loss_on,
                            enable_thinking=enable_thinking) for row in rows]
    if not use_cache:
        return TokenizedDataset(samples, key, cache_hit=False, cache_path=None)
    meta = {"tokenizer_dir": str(directory), "data": [str(p) for p in paths], "loss_on": loss_on,
            "enable_thinking": enable_thinking}
    return TokenizedDataset(samples, key, cache_hit=False, cache_path=cache.put(key, samples, meta))


@dataclass
class TokenizedPairs:
    pairs: list[tuple[TokenizedSample, TokenizedSample]]  # (chosen, rejected), in input order
    key: str
    cache_hit: bool
    cache_path: Path | None


def tokenize_preference_dataset(paths: str | Path | list[str | Path], *, tokenizer_dir: str | Path | None = None,
                                enable_thinking: bool = True, schema: dict[str, Any] | None = None,
                                cache_dir: str | Path | None = None, use_cache: bool = True) -> TokenizedPairs:
    """Tokenize preference files (preferences.tokenize_pair) through the cache.

    Args:
        paths: data files/directories of preference rows (see sources.read_rows).
        tokenizer_dir: model or tokenizer directory; None for the bundled tiny tokenizer.
        enable_thinking: see chat_template.tokenize_conversation.
        schema: optional final-answer JSON Schema for chosen answers, enforced on a miss.
        cache_dir: cache root (default in module docstring).
        use_cache: False always tokenizes and writes nothing.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    template = load_chat_template(directory)
    key = cache_key(tokenizer_hash=tokenizer_sha256(directory), template=template, data_hash=inputs_sha256(paths),
                    loss_on="completion", enable_thinking=enable_thinking, schema=schema, kind="preference")
    cache = TokenizationCache(cache_dir)
    if use_cache and (samples := cache.get(key)) is not None:
        return TokenizedPairs(list(zip(samples[0::2], samples[1::2])), key, cache_hit=True, cache_path=cache.path(key))
    tokenizer = load_tokenizer(directory)
    rows = check_preferences_or_raise(read_rows(paths), schema)
    pairs = [tokenize_pair(row.data, tokenizer, template=template, enable_thinking=enable_thinking,
                           name=str(row.origin)) for row in rows]
    if not use_cache:
        return TokenizedPairs(pairs, key, cache_hit=False, cache_path=None)
    meta = {"kind": "preference", "num_pairs": len(pairs), "tokenizer_dir": str(directory),
            "data": [str(p) for p in paths], "enable_thinking": enable_thinking}
    path = cache.put(key, [sample for pair in pairs for sample in pair], meta)
    return TokenizedPairs(pairs, key, cache_hit=False, cache_path=path)
