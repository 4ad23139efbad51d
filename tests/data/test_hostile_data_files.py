"""Files of the data pipeline that glmtune wrote earlier or a user handed over, hostile: a prepared
dataset's manifest.json, a tokenization cache entry, a tokenizer directory's JSON files. Each
variant is one ValueError naming the file, never a traceback of another type, never a name that
leads out of its directory, never an unpickled array.

A damaged cache entry is refused, not tokenized over: the sentence says to delete it (a silent
miss would hide what damages the cache; the file may be another tool's).
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from glmtune.cli import main
from glmtune.data.prepare import split_files
from glmtune.data.synthetic import generate_rows, write_jsonl
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.token_cache import TokenizationCache, tokenize_dataset, tokenize_preference_dataset
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from tests.train.run_helpers import TWO_STEPS, run, shared_run

DEEP = "[" * 100_000 + "]" * 100_000
SPLITS = ("train", "validation", "test")


def _outputs(**files) -> str:
    return json.dumps({"outputs": {split: {"file": files.get(split, f"{split}.jsonl")} for split in SPLITS}})


MANIFESTS = {  # manifest.json -> what the sentence says
    "truncated": (_outputs()[:30], "not valid JSON"),
    "nested deep": (DEEP, "nested deeper than 64 levels"),
    "a list": ("[]", "is a list, not an object"),
    "outputs a list": ('{"outputs": []}', "its outputs are not one object per split"),
    "a split missing": (json.dumps({"outputs": {"train": {"file": "t.jsonl"}}}), "not one object per split"),
    "an entry a string": (json.dumps({"outputs": dict.fromkeys(SPLITS, "x.jsonl")}), "not one object per split"),
    "a file name a number": (_outputs(train=5), "outputs.train.file names 5, which is not a file name"),
    "traversal": (_outputs(train="../../etc/passwd"), "outputs.train.file names '../../etc/passwd', which leaves"),
    "absolute path": (_outputs(validation="/etc/passwd"), "which is an absolute path"),
    "a subdirectory": (_outputs(test="sub/test.jsonl"), "which is not a plain file name"),
    "planted keys only": (json.dumps({"version": "x", "__class__": "y"}), "its outputs are not one object per split"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_hostile_prepared_manifest_is_one_sentence_naming_it(tmp_path, case):
    content, said = MANIFESTS[case]
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ValueError) as refused:
        split_files(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"prepared data manifest {tmp_path / 'manifest.json'}: ") and said in message


def test_a_split_file_linking_out_of_the_prepared_directory_is_refused(tmp_path):
    (tmp_path / "prep").mkdir()
    (tmp_path / "secret.jsonl").write_text("{}\n")
    (tmp_path / "prep" / "train.jsonl").symlink_to(tmp_path / "secret.jsonl")
    (tmp_path / "prep" / "manifest.json").write_text(_outputs())
    with pytest.raises(ValueError, match=r"outputs.train.file names 'train.jsonl', which is a link that leads out"):
        split_files(tmp_path / "prep")


# -- the tokenization cache -------------------------------------------------------------------------------

def _npz(compress: bool = False, **arrays) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buffer, **arrays)
    return buffer.getvalue()


IDS, LABELS, OFFSETS = np.array([5, 6, 7], np.int32), np.array([-100, 6, 7], np.int32), np.array([0, 1, 3])


def _lying_header() -> bytes:
    """An archive as np.savez writes one, whose input_ids header claims 2**40 elements (numpy would
    allocate them) over the 12 bytes of 3."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in (("input_ids", IDS), ("labels", LABELS), ("offsets", OFFSETS)):
            member = io.BytesIO()
            shape = (1 << 40,) if name == "input_ids" else array.shape
            np.lib.format.write_array_header_1_0(member, {"descr": array.dtype.str, "fortran_order": False,
                                                          "shape": shape})
            archive.writestr(f"{name}.npy", member.getvalue() + array.tobytes())
    return buffer.getvalue()


ENTRIES = {  # the .npz under the key -> what the sentence says
    "truncated": (lambda good: good[: len(good) // 2], "File is not a zip file"),
    "empty": (lambda good: b"", "File is not a zip file"),
    "text": (lambda good: b"not an archive", "File is not a zip file"),
    "a pickled object array": (lambda good: _npz(input_ids=np.array([{"x": 1}], dtype=object), labels=LABELS,
                                                 offsets=OFFSETS), "header does not describe"),
    "float ids": (lambda good: _npz(input_ids=IDS.astype(np.float32), labels=LABELS, offsets=OFFSETS),
                  "input_ids is float32 of shape (3,), not a flat int32 array"),
    "2-D ids": (lambda good: _npz(input_ids=IDS.reshape(1, 3), labels=LABELS, offsets=OFFSETS),
                "not a flat int32 array"),
    "offsets past the end": (lambda good: _npz(input_ids=IDS, labels=LABELS, offsets=np.array([0, 9])),
                             "its offsets do not cut its tokens into samples"),
    "offsets going back": (lambda good: _npz(input_ids=IDS, labels=LABELS, offsets=np.array([0, 2, 1, 3])),
                           "its offsets do not cut"),
    "a member missing": (lambda good: _npz(input_ids=IDS, labels=LABELS), "members"),
    "a member planted": (lambda good: _npz(input_ids=IDS, labels=LABELS, offsets=OFFSETS, extra=IDS), "members"),
    "compressed": (lambda good: _npz(True, input_ids=IDS, labels=LABELS, offsets=OFFSETS), "is compressed"),
    "a header lying about its size": (lambda good: _lying_header(), "header does not describe"),
    "negative ids": (lambda good: _npz(input_ids=-IDS, labels=np.full(3, -100, np.int32), offsets=OFFSETS),
                     "negative token ids"),
    "labels of other tokens": (lambda good: _npz(input_ids=IDS, labels=IDS + 1, offsets=OFFSETS),
                               "labels that are neither -100 nor the token"),
    "ids beyond the tokenizer": (lambda good: _npz(input_ids=IDS + 5000, labels=LABELS * 0 - 100,
                                                   offsets=OFFSETS), "token ids of 4096 or more"),
}


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> tuple[Path, Path, str, bytes]:
    """(data file, cache directory, key, the entry's bytes) of 6 tokenized rows."""
    root = tmp_path_factory.mktemp("cached")
    data = write_jsonl(generate_rows(6, seed=3), root / "rows.jsonl")
    first = tokenize_dataset([data], cache_dir=root / "cache")
    return data, root / "cache", first.key, first.cache_path.read_bytes()


@pytest.mark.parametrize("case", list(ENTRIES))
def test_a_hostile_cache_entry_is_refused_naming_it(cached, tmp_path, case):
    data, cache_dir, key, good = cached
    cache = shutil.copytree(cache_dir, tmp_path / "cache")
    entry = TokenizationCache(cache).path(key)
    make, said = ENTRIES[case]
    entry.write_bytes(make(good))
    with pytest.raises(ValueError) as refused:
        tokenize_dataset([data], cache_dir=cache, vocab_size=len(load_tokenizer()))
    message = str(refused.value)
    assert message.startswith(f"{entry}: not a tokenization cache entry glmtune writes (") and said in message
    assert message.endswith("; delete it to tokenize again")
    assert entry.read_bytes() == make(good)  # refused, not tokenized over


def test_an_intact_entry_is_a_hit_and_an_odd_preference_entry_is_refused(cached, tmp_path):
    data, cache_dir, key, _ = cached
    assert tokenize_dataset([data], cache_dir=cache_dir, vocab_size=len(load_tokenizer())).cache_hit
    pairs = write_jsonl(generate_preference_rows(2, seed=1), tmp_path / "pairs.jsonl")
    first = tokenize_preference_dataset([pairs], cache_dir=tmp_path / "cache")
    samples = [sample for pair in first.pairs for sample in pair][:-1]  # the last rejected answer gone
    TokenizationCache(tmp_path / "cache").put(first.key, samples)
    with pytest.raises(ValueError, match=r"not a tokenization cache entry of preference pairs \(3 samples"):
        tokenize_preference_dataset([pairs], cache_dir=tmp_path / "cache")


# -- a tokenizer directory ---------------------------------------------------------------------------------

TOKENIZER_FILES = {  # (file, what it becomes) -> what the sentence says
    "tokenizer.json truncated": ("tokenizer.json", lambda t: t[:2000], "tokenizer file", "not valid JSON"),
    "tokenizer.json nested deep": ("tokenizer.json", lambda t: DEEP, "tokenizer file", "nested deeper than 64"),
    "tokenizer.json a list": ("tokenizer.json", lambda t: "[]", "tokenizer file", "is a list, not an object"),
    "config nested deep": ("tokenizer_config.json", lambda t: DEEP, "tokenizer file", "nested deeper than 64"),
    "config a list": ("tokenizer_config.json", lambda t: "[1]", "tokenizer file", "is a list, not an object"),
    "config class a number": ("tokenizer_config.json",
                              lambda t: json.dumps({**json.loads(t), "tokenizer_class": 5}),
                              "tokenizer in", "does not load"),
    "config added tokens a list": ("tokenizer_config.json",
                                   lambda t: json.dumps({**json.loads(t), "added_tokens_decoder": [1]}),
                                   "tokenizer in", "does not load"),
    "config eos a list": ("tokenizer_config.json", lambda t: json.dumps({**json.loads(t), "eos_token": [1]}),
                          "tokenizer in", "does not load"),
    "special tokens map a list": ("special_tokens_map.json", lambda t: "[]", "tokenizer file",
                                  "is a list, not an object"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_FILES))
def test_a_hostile_tokenizer_file_is_one_sentence_naming_it(tmp_path, case):
    name, change, label, said = TOKENIZER_FILES[case]
    directory = Path(shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "tok"))
    original = (directory / name).read_text() if (directory / name).is_file() else "{}"
    (directory / name).write_text(change(original))
    with pytest.raises(ValueError) as refused:
        load_tokenizer(directory)
    message = str(refused.value)
    shown = directory / name if label == "tokenizer file" else directory
    assert message.startswith(f"{label} {shown}") and said in message and "\n" not in message


def test_the_cache_never_unpickles(cached, tmp_path, monkeypatch):
    """np.load (which unpickles when told to) is never called: the members are read as raw arrays."""
    data, cache_dir, _, _ = cached

    def refuse(*args, **kwargs):
        raise AssertionError("np.load called on a cache entry")

    monkeypatch.setattr(np, "load", refuse)
    assert tokenize_dataset([data], cache_dir=cache_dir).cache_hit
    assert zipfile.is_zipfile(next((cache_dir / "tokenized").glob("*.npz")))


# -- through `glmtune train` ------------------------------------------------------------------------------

def _train_refused(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("glmtune train: error: ")]
    for fragment in fragments:
        assert fragment in line, line


def test_glmtune_train_refuses_a_damaged_cache_entry_and_a_hostile_tokenizer(shared_results, tmp_path):
    finished = shared_run(shared_results, *TWO_STEPS)
    cache = Path(shutil.copytree(finished.cache_dir, tmp_path / "cache"))
    entries = sorted((cache / "tokenized").glob("*.npz"))
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:100])  # cut short
    result = run(tmp_path / "run", cache, *TWO_STEPS)
    _train_refused(result, "not a tokenization cache entry glmtune writes", "delete it to tokenize again")
    assert [e.stat().st_size for e in entries] == [100] * len(entries)  # nothing tokenized over

    tokenizer = Path(shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "tokenizer"))
    (tokenizer / "tokenizer_config.json").write_text(DEEP)
    result = run(tmp_path / "run2", tmp_path / "cache2", *TWO_STEPS, "--data.tokenizer", str(tokenizer))
    _train_refused(result, f"tokenizer file {tokenizer / 'tokenizer_config.json'}: JSON nested deeper than 64")


# -- a `datasets` save_to_disk directory -------------------------------------------------------------------

def _saved_dataset(directory: Path, content: str) -> Path:
    import datasets

    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    datasets.Dataset.from_list([row]).save_to_disk(str(directory))
    return directory


DATASETS = {  # state.json's _data_files (or dataset_dict.json) -> what the sentence says
    "traversal to another dataset": (lambda other: {"_data_files": [{"filename": f"../other/{other}"}]},
                                     "_data_files names '../other/", "which leaves"),
    "absolute path": (lambda other: {"_data_files": [{"filename": f"/tmp/{other}"}]}, "_data_files names",
                      "which is an absolute path"),
    "a file name a number": (lambda other: {"_data_files": [{"filename": 3}]}, "names 3", "not a file name"),
    "files a string": (lambda other: {"_data_files": "data.arrow"}, "_data_files is a string", "not a list"),
    "state nested deep": (lambda other: DEEP, "`datasets` state", "nested deeper than 64 levels"),
}


@pytest.mark.parametrize("case", list(DATASETS))
def test_a_datasets_directory_never_leads_out_of_itself(tmp_path, capsys, case):
    pytest.importorskip("datasets")
    directory = _saved_dataset(tmp_path / "mine", "mine")
    other = _saved_dataset(tmp_path / "other", "SECRET")
    [shard] = [p.name for p in other.glob("*.arrow")]
    state = directory / "state.json"
    make, *said = DATASETS[case]
    value = make(shard)
    state.write_text(value if isinstance(value, str) else json.dumps({**json.loads(state.read_text()), **value}))
    capsys.readouterr()  # datasets' progress bars while saving
    code = main(["data", "validate", str(directory)])
    out, err = capsys.readouterr()
    assert code == 2 and "SECRET" not in out + err and "Traceback" not in err, out + err
    assert err.startswith("glmtune data validate: error: `datasets` state") and str(state) in err, err
    for fragment in said:
        assert fragment in err, err


def test_a_datasets_split_that_leads_out_is_refused(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    _saved_dataset(tmp_path / "other", "SECRET")
    listing = tmp_path / "dict" / "dataset_dict.json"
    listing.write_text(json.dumps({"splits": ["train", "../other"]}))
    capsys.readouterr()  # datasets' progress bars while saving
    code = main(["data", "validate", str(tmp_path / "dict")])
    out, err = capsys.readouterr()
    assert code == 2 and "SECRET" not in out + err, out + err
    assert f"`datasets` listing {listing}: splits names '../other', which leaves" in err, err
