"""Tokenization cache: hits reuse results, every key component forces a miss."""

from __future__ import annotations

import shutil

import pytest

import glmtune.data.token_cache as cache_module
from glmtune.data.token_cache import StreamingEntry, TokenizationCache, cache_key, default_cache_dir, tokenize_dataset
from glmtune.data.chat_template import TokenizedSample
from glmtune.data.synthetic import generate_rows, load_schema, write_jsonl
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR


@pytest.fixture
def data_file(tmp_path):
    return write_jsonl(generate_rows(30, seed=11), tmp_path / "d.jsonl")


def test_key_changes_with_every_component():
    base = dict(tokenizer_hash="t", template="T", data_hash="d", loss_on="all_assistant", enable_thinking=True)
    key = cache_key(**base)
    assert cache_key(**base) == key
    for change in ({"tokenizer_hash": "t2"}, {"template": "T2"}, {"data_hash": "d2"},
                   {"loss_on": "last_assistant"}, {"enable_thinking": False}, {"schema": {"type": "object"}}):
        assert cache_key(**{**base, **change}) != key, change


def test_put_get_round_trip(tmp_path):
    cache = TokenizationCache(tmp_path)
    samples = [TokenizedSample([1, 2, 3], [-100, 2, 3]), TokenizedSample([154820], [154820])]
    assert cache.get("k") is None
    path = cache.put("k", samples, {"note": "x"})
    assert path == tmp_path / "tokenized" / "k.npz" and path.with_suffix(".json").is_file()
    assert cache.get("k") == samples
    assert not list((tmp_path / "tokenized").glob("*.tmp"))


def test_default_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GLMTUNE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GLMTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "glmtune"


def test_hit_skips_tokenization_and_misses_follow_inputs(tmp_path, data_file, monkeypatch):
    cache_dir = tmp_path / "cache"
    first = tokenize_dataset([data_file], cache_dir=cache_dir)
    assert not first.cache_hit and first.cache_path.is_file() and len(first.samples) == 30

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not load the tokenizer")

    monkeypatch.setattr(cache_module, "load_tokenizer", refuse)
    hit = tokenize_dataset([data_file], cache_dir=cache_dir)
    assert hit.cache_hit and hit.key == first.key and hit.samples == first.samples
    monkeypatch.undo()

    keys = {first.key}
    for kwargs in ({"loss_on": "last_assistant"}, {"enable_thinking": False}, {"schema": load_schema()}):
        result = tokenize_dataset([data_file], cache_dir=cache_dir, **kwargs)
        assert not result.cache_hit and result.key not in keys
        keys.add(result.key)
    last_only = tokenize_dataset([data_file], cache_dir=cache_dir, loss_on="last_assistant")
    assert last_only.cache_hit and last_only.samples != first.samples

    # A changed template or tokenizer file in a copied tokenizer directory is a new key.
    tokenizer_dir = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, tokenizer_dir)
    same = tokenize_dataset([data_file], tokenizer_dir=tokenizer_dir, cache_dir=cache_dir)
    assert same.cache_hit  # identical files, identical key, wherever they live
    (tokenizer_dir / "chat_template.jinja").write_text((tokenizer_dir / "chat_template.jinja").read_text() + " ")
    assert not tokenize_dataset([data_file], tokenizer_dir=tokenizer_dir, cache_dir=cache_dir).cache_hit
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace("202752", "4096"))
    assert not tokenize_dataset([data_file], tokenizer_dir=tokenizer_dir, cache_dir=cache_dir).cache_hit

    # New data content is a miss even at the same path.
    write_jsonl(generate_rows(31, seed=11), data_file)
    changed = tokenize_dataset([data_file], cache_dir=cache_dir)
    assert not changed.cache_hit and len(changed.samples) == 31

    uncached = tokenize_dataset([data_file], cache_dir=tmp_path / "unused", use_cache=False)
    assert uncached.cache_path is None and not (tmp_path / "unused").exists()
    assert uncached.samples == changed.samples


def test_a_streamed_entry_whose_commit_fails_leaves_no_files(tmp_path, monkeypatch):
    """A full disk while the `.npz` is written (it holds the stream twice beside the stream: a 5 GiB
    corpus's 8.4 GB of tokens ran a machine out of disk): the partial archive and the stream are
    removed, the error raised, nothing left in the cache directory; a later commit works."""
    cache = TokenizationCache(tmp_path / "cache")
    entry = StreamingEntry(cache, "k" * 64)
    entry.append([1, 2, 3])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(cache_module.np.lib.format, "write_array_header_1_0", full_disk)
        with pytest.raises(OSError, match="No space left"):
            entry.commit({})
    assert list(cache.directory.iterdir()) == []
    again = StreamingEntry(cache, "k" * 64)
    again.append([1, 2, 3])
    assert again.commit({}).is_file()
