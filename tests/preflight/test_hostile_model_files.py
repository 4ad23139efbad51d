"""What preflight reads of a model directory and of its own scratch runs, hostile: config.json
(checks 1-4), the index's file names and the download's records (check 2), metrics.jsonl (the
scratch runs). Each is a failed check whose message names the file, never an exception's class
from deep inside a parser, and no file the index leads out of the directory is hashed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.checkpoint.integrity import file_digest
from glmtune.cli import main
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.io.revisions import model_revision
from glmtune.preflight.loading import check_model
from glmtune.preflight.runs import read_records
from glmtune.preflight.shards import check_shards
from tests.checkpoint_fixtures import weight_map
from tests.preflight.conftest import SFT

DEEP = "[" * 100_000 + "]" * 100_000


def _config(ckpt: Path, change) -> Path:
    path = ckpt / "config.json"
    content = change(json.loads(path.read_text())) if callable(change) else change
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


CONFIGS = {  # config.json -> what check 3 says of it
    "nested deep": (DEEP, "JSON nested too deep for a config"),
    "truncated": (lambda c: json.dumps(c)[:40], "invalid JSON"),
    "a list": ("[1]", "not a config (a JSON object)"),
    "not UTF-8": (b'{"model_type": "\xff"}', "not UTF-8 text"),
    "architectures a string": (lambda c: json.dumps({**c, "architectures": c["architectures"][0]}),
                               "architectures is a string, not a list of class names"),
    "hidden_size a string": (lambda c: json.dumps({**c, "hidden_size": "big"}),
                             "hidden_size is 'big', not a non-negative integer"),
    "rope_parameters a list": (lambda c: json.dumps({**c, "rope_parameters": [1]}),
                               "rope_parameters is [1], not an object"),
    "indexer_types a number": (lambda c: json.dumps({**c, "indexer_types": 5}),
                               "indexer_types is 5, not a list of layer kinds"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_hostile_config_json_fails_check_3_naming_it(ckpt, fresh, case):
    change, said = CONFIGS[case]
    path = _config(ckpt, change)
    result = check_model(fresh(SFT, "--model.name_or_path", str(ckpt), "--data.tokenizer", str(TINY_TOKENIZER_DIR)))
    assert result.status == "fail" and str(path) in result.message and said in result.message, result.message


@pytest.mark.parametrize("case", ["nested deep", "hidden_size a string"])
def test_glmtune_preflight_names_the_hostile_config_in_every_check_that_reads_it(ckpt, tmp_path, case):
    path = _config(ckpt, CONFIGS[case][0])
    status = main(["preflight", str(SFT), "--model.name_or_path", str(ckpt), "--data.tokenizer",
                   str(TINY_TOKENIZER_DIR), "--out", str(tmp_path / "out")])
    checks = json.loads((tmp_path / "out" / "preflight.json").read_text())["checks"]
    assert status == 1 and [c["status"] for c in checks[:4]] == ["fail"] * 4
    for check in checks[:4]:  # pins, shards, model, trainable: each reads config.json
        assert str(path) in check["message"] and CONFIGS[case][1] in check["message"], check["message"]
        assert "Error:" not in check["message"].split(str(path))[0].replace("ValueError:", ""), check["message"]


def _record_download(ckpt: Path, name: str, sha256: str) -> None:
    """What `huggingface-cli download --local-dir` records of shard `name`: commit, etag (sha256), time."""
    metadata = ckpt / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    metadata.parent.mkdir(parents=True, exist_ok=True)
    metadata.write_text(f"{'a' * 40}\n{sha256}\n1700000000.0\n")


def test_a_shard_the_index_leads_out_of_the_directory_is_never_hashed(ckpt, fresh, tmp_path):
    index = ckpt / INDEX_NAME
    mapping = json.loads(index.read_text())
    first = sorted(set(weight_map(ckpt).values()))[0]
    outside = Path(shutil.move(ckpt / first, tmp_path / "outside.safetensors"))
    mapping["weight_map"] = {k: "../outside.safetensors" if v == first else v for k, v in weight_map(ckpt).items()}
    index.write_text(json.dumps(mapping))
    (ckpt / ".cache" / "huggingface" / "download").mkdir(parents=True)
    _record_download(ckpt, "../outside.safetensors", file_digest(outside)["sha256"])
    # and a shard inside that is a link out, its hash recorded too
    second = sorted(set(weight_map(ckpt).values()) - {"../outside.safetensors"})[0]
    shutil.move(ckpt / second, tmp_path / "linked.safetensors")
    (ckpt / second).symlink_to(tmp_path / "linked.safetensors")
    _record_download(ckpt, second, file_digest(tmp_path / "linked.safetensors")["sha256"])
    result = check_shards(fresh(SFT, "--model.name_or_path", str(ckpt)))
    assert result.status == "fail" and INDEX_NAME in result.message and "leaves the checkpoint" in result.message
    hashed = {name for name, entry in result.evidence["sha256"].items() if isinstance(entry, dict)}
    assert hashed.isdisjoint({"../outside.safetensors", second}), result.evidence["sha256"]


def test_an_unreadable_download_record_is_no_hash_not_a_crash(ckpt, fresh):
    first = sorted(set(weight_map(ckpt).values()))[0]
    metadata = ckpt / ".cache" / "huggingface" / "download" / f"{first}.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_bytes(b"\xff\xfe" * 10 + b"\n" + b"\xff" * (1 << 20))  # not UTF-8, and long
    (metadata.parent / "config.json.metadata").write_bytes(b"\xff" * 100)
    result = check_shards(fresh(SFT, "--model.name_or_path", str(ckpt)))
    assert result.status == "pass" and result.evidence["sha256"][first] == "no recorded hash", result.message
    assert model_revision(ckpt)[0] is None
    (metadata.parent / "config.json.metadata").unlink()
    os.mkfifo(metadata.parent / "config.json.metadata")  # never opened: no record, no wait for a writer
    assert model_revision(ckpt)[0] is None


@pytest.mark.parametrize("lines, said", [
    (['{"step": 1}', "[1]"], ":2: is a list, not an object"),
    (['{"step": 1}', '{"loss": 2}'], ":2: a record without an integer step"),
    (['{"step": 1}', DEEP], ":2: JSON nested deeper than 64 levels"),
])
def test_a_scratch_runs_hostile_metrics_line_is_named(tmp_path, lines, said):
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"metrics file {tmp_path / 'metrics.jsonl'}{said}"):
        read_records(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # killed mid-line: read up to it
    assert list(read_records(tmp_path)) == [1]
