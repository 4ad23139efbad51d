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

A cache directory is a place anyone may write to, so an entry is read as untrusted: its
arrays straight from the `.npz` members (`np.savez`'s uncompressed `.npy` files; each header
must describe its member's bytes exactly; no object dtype, so nothing is ever unpickled),
then checked for what `put` writes (flat int32 ids and labels, int64 offsets cutting them into
samples, ids below the tokenizer's size, labels -100 or the token at their position). An
entry that is anything else (cut short, damaged, planted) is refused in one sentence naming
its file and saying to delete it, rather than silently tokenized over: a miss would hide a
disk or a process that damages the cache, and the file may be another tool's.

Cache directory: the `cache_dir` argument, else $GLMTUNE_CACHE_DIR, else
$XDG_CACHE_HOME/glmtune, else ~/.cache/glmtune; entries live in `tokenized/`.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from glmtune.data.chat_template import (IGNORE_INDEX, LOSS_ON_CHOICES, LossOn, TokenizedSample, chat_format,
                                        control_tokens, load_chat_template, tokenize_row)
from glmtune.data.contract import check_or_raise
from glmtune.data.preferences import check_preferences_or_raise, tokenize_pair
from glmtune.data.sources import inputs_sha256, read_rows
from glmtune.data.tokenizer import TOKENIZER_FILES, load_tokenizer, resolve_tokenizer_dir
from glmtune.io.regular import open_regular
from glmtune.io.text_limits import clipped

# Bump when tokenization output changes for the same inputs (mask rules, eos handling).
CACHE_FORMAT_VERSION = 1
_ENTRY_DTYPES = {"input_ids": np.int32, "labels": np.int32, "offsets": np.int64}  # what `put` writes


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


def _entry_problem(arrays: dict[str, np.ndarray], vocab_size: int | None) -> str | None:
    """What makes `arrays` other than what `TokenizationCache.put` writes (None when nothing)."""
    for name, dtype in _ENTRY_DTYPES.items():
        if arrays[name].dtype != dtype or arrays[name].ndim != 1:
            return (f"{name} is {arrays[name].dtype} of shape {arrays[name].shape}, not a flat {np.dtype(dtype).name} "
                    "array")
    input_ids, labels, offsets = arrays["input_ids"], arrays["labels"], arrays["offsets"]
    if len(labels) != len(input_ids) or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(input_ids) \
            or bool((np.diff(offsets) < 0).any()):
        return "its offsets do not cut its tokens into samples"
    if bool((input_ids < 0).any()):
        return "negative token ids"
    if vocab_size is not None and bool((input_ids >= vocab_size).any()):
        return f"token ids of {vocab_size} or more, beyond the tokenizer's {vocab_size} tokens"
    if not bool(((labels == IGNORE_INDEX) | (labels == input_ids)).all()):
        return f"labels that are neither {IGNORE_INDEX} nor the token at their position"
    return None


def _read_members(fh: BinaryIO) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` as `np.savez` writes it: its three members stored uncompressed, each
    `.npy` header checked against the member's size before its data is read (no header can make
    numpy allocate more than the file holds), no object dtype (nothing is unpickled, ever)."""
    arrays = {}
    with zipfile.ZipFile(fh) as archive:
        members = archive.infolist()
        if sorted(m.filename for m in members) != sorted(f"{name}.npy" for name in _ENTRY_DTYPES):
            raise ValueError(f"members {clipped([m.filename for m in members], 120)}, not {sorted(_ENTRY_DTYPES)}")
        for member in members:
            if member.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{member.filename} is compressed")
            with archive.open(member) as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                size = math.prod(shape) * dtype.itemsize
                if dtype.hasobject or fortran or size != member.file_size - f.tell():
                    raise ValueError(f"{member.filename}'s header does not describe its {member.file_size:,} bytes")
                arrays[member.filename.removesuffix(".npy")] = np.frombuffer(f.read(size), dtype).reshape(shape)
    return arrays


def _read_entry(path: Path, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, offsets) of a cache entry, read (`_read_members`) and checked
    (`_entry_problem`); ValueError naming the file for anything else."""
    refusal = f"{path}: not a tokenization cache entry glmtune writes ({{}}); delete it to tokenize again"
    with open_regular(path, "tokenization cache entry") as fh:
        try:
            arrays = _read_members(fh)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(refusal.format(clipped(exc))) from None
    problem = _entry_problem(arrays, vocab_size)
    if problem:
        raise ValueError(refusal.format(problem))
    return arrays["input_ids"], arrays["labels"], arrays["offsets"]


class TokenizationCache:
    """`get`/`put` lists of TokenizedSample under `<cache_dir>/tokenized/<key>.npz`."""

    def __init__(self, cache_dir: str | Path | None = None):
        self.root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.directory = self.root / "tokenized"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.npz"

    def get(self, key: str, vocab_size: int | None = None) -> list[TokenizedSample] | None:
        """The samples stored under `key` (None when there is no entry); an entry that is not what
        `put` writes (token ids at or above `vocab_size` included) is a ValueError naming its file."""
        path = self.path(key)
        if not os.path.lexists(path):
            return None
        input_ids, labels, offsets = _read_entry(path, vocab_size)
        return [TokenizedSample(input_ids[start:end].tolist(), labels[start:end].tolist())
                for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist())]

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


class StreamingEntry:
    """A cache entry written a sample at a time, for corpora larger than memory (raw text,
    `text_corpus.py`): the tokens go to a temporary file as they come, only the offsets stay in
    memory; `commit` then writes the `.npz` exactly as `put` would (same members, `.npy` headers
    and checks on read) by copying that file in chunks, and puts it in place atomically. Labels are
    the tokens themselves (every token of raw text is a target; the packer applies the boundary
    rule)."""

    def __init__(self, cache: TokenizationCache, key: str):
        cache.directory.mkdir(parents=True, exist_ok=True)
        self.path, self.key = cache.path(key), key
        fd, raw = tempfile.mkstemp(dir=cache.directory, prefix=f".{key}.", suffix=".tokens")
        self.raw_path = Path(raw)
        self.raw = os.fdopen(fd, "wb")
        self.offsets = array.array("q", [0])

    def append(self, input_ids: list[int]) -> None:
        np.asarray(input_ids, dtype=np.int32).tofile(self.raw)
        self.offsets.append(self.offsets[-1] + len(input_ids))

    def commit(self, meta: dict[str, Any]) -> Path:
        """Write the entry; a failure (a full disk: the `.npz` holds the stream twice, input_ids and
        labels, beside the stream itself) removes the partial `.npz` and the stream, and raises."""
        self.raw.close()
        num_tokens = self.offsets[-1]
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                self._write_members(archive, num_tokens)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            self.raw_path.unlink(missing_ok=True)
            raise
        self.raw_path.unlink()
        sidecar = {"key": self.key, "num_samples": len(self.offsets) - 1, "num_tokens": num_tokens, **meta}
        self.path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")
        return self.path

    def _write_members(self, archive: zipfile.ZipFile, num_tokens: int) -> None:
        for name in ("input_ids", "labels"):
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member, open(self.raw_path, "rb") as raw:
                np.lib.format.write_array_header_1_0(member, {"descr": np.lib.format.dtype_to_descr(
                    np.dtype(np.int32)), "fortran_order": False, "shape": (num_tokens,)})
                while chunk := raw.read(1 << 22):
                    member.write(chunk)
        with archive.open("offsets.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.frombuffer(self.offsets, dtype=np.int64), allow_pickle=False)

    def discard(self) -> None:
        self.raw.close()
        self.raw_path.unlink(missing_ok=True)


@dataclass
class TokenizedDataset:
    samples: list[TokenizedSample]
    key: str
    cache_hit: bool
    cache_path: Path | None


def tokenize_dataset(paths: str | Path | list[str | Path], *, tokenizer_dir: str | Path | None = None,
                     loss_on: LossOn = "all_assistant", enable_thinking: bool = True,
                     schema: dict[str, Any] | None = None, cache_dir: str | Path | None = None,
                     use_cache: bool = True, vocab_size: int | None = None) -> TokenizedDataset:
    """Tokenize data files with a tokenizer's chat template, through the cache.

    Args:
        paths: data files/directories (see sources.read_rows).
        tokenizer_dir: model or tokenizer directory; None for the bundled tiny tokenizer.
            Its own chat template is used, else the bundled GLM-5 template.
        loss_on, enable_thinking: see chat_template.tokenize_conversation.
        schema: optional final-answer JSON Schema enforced by the contract on a miss.
        cache_dir: cache root (default in module docstring).
        use_cache: False always tokenizes and writes nothing.
        vocab_size: the tokenizer's size, when known: a cached entry holding a larger id is refused.
    """
    if loss_on not in LOSS_ON_CHOICES:
        raise ValueError(f"loss_on must be one of {LOSS_ON_CHOICES}, got {loss_on!r}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    template = load_chat_template(directory)
    chat_format(template)  # a template whose turns glmtune cannot tell: refused before anything is read
    key = cache_key(tokenizer_hash=tokenizer_sha256(directory), template=template, data_hash=inputs_sha256(paths),
                    loss_on=loss_on, enable_thinking=enable_thinking, schema=schema)
    cache = TokenizationCache(cache_dir)
    if use_cache and (samples := cache.get(key, vocab_size)) is not None:
        return TokenizedDataset(samples, key, cache_hit=True, cache_path=cache.path(key))
    tokenizer = load_tokenizer(directory)
    rows = check_or_raise(read_rows(paths), schema, control_tokens=control_tokens(template, tokenizer))
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
                                cache_dir: str | Path | None = None, use_cache: bool = True,
                                vocab_size: int | None = None) -> TokenizedPairs:
    """Tokenize preference files (preferences.tokenize_pair) through the cache.

    Args:
        paths: data files/directories of preference rows (see sources.read_rows).
        tokenizer_dir: model or tokenizer directory; None for the bundled tiny tokenizer.
        enable_thinking: see chat_template.tokenize_conversation.
        schema: optional final-answer JSON Schema for chosen answers, enforced on a miss.
        cache_dir: cache root (default in module docstring).
        use_cache: False always tokenizes and writes nothing.
        vocab_size: the tokenizer's size, when known: a cached entry holding a larger id is refused.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    directory = resolve_tokenizer_dir(tokenizer_dir)
    template = load_chat_template(directory)
    chat_format(template)  # a template whose turns glmtune cannot tell: refused before anything is read
    key = cache_key(tokenizer_hash=tokenizer_sha256(directory), template=template, data_hash=inputs_sha256(paths),
                    loss_on="completion", enable_thinking=enable_thinking, schema=schema, kind="preference")
    cache = TokenizationCache(cache_dir)
    if use_cache and (samples := cache.get(key, vocab_size)) is not None:
        if len(samples) % 2:
            raise ValueError(f"{cache.path(key)}: not a tokenization cache entry of preference pairs ({len(samples)} "
                             "samples, an odd number); delete it to tokenize again")
        return TokenizedPairs(list(zip(samples[0::2], samples[1::2])), key, cache_hit=True, cache_path=cache.path(key))
    tokenizer = load_tokenizer(directory)
    rows = check_preferences_or_raise(read_rows(paths), schema, control_tokens=control_tokens(template, tokenizer))
    pairs = [tokenize_pair(row.data, tokenizer, template=template, enable_thinking=enable_thinking,
                           name=str(row.origin)) for row in rows]
    if not use_cache:
        return TokenizedPairs(pairs, key, cache_hit=False, cache_path=None)
    meta = {"kind": "preference", "num_pairs": len(pairs), "tokenizer_dir": str(directory),
            "data": [str(p) for p in paths], "enable_thinking": enable_thinking}
    path = cache.put(key, [sample for pair in pairs for sample in pair], meta)
    return TokenizedPairs(pairs, key, cache_hit=False, cache_path=path)
