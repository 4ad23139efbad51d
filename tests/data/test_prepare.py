"""`prepare`: dedup, group-aware split, PII actions, content-hash outputs, manifest."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict

import pytest
from data_test_helpers import chat

from glmtune.data.dedup import dedup_rows, normalize_text
from glmtune.data.prepare import MANIFEST_NAME, PII_REPORT_NAME, prepare_dataset, split_files
from glmtune.data.sources import Origin, Row
from glmtune.data.split import assign_split, parse_ratios, split_key, split_rows
from glmtune.data.synthetic import SCHEMA_PATH, generate_rows


def rows_of(*datas):
    return [Row(data, Origin("mem", i)) for i, data in enumerate(datas)]


def test_dedup_exact_then_normalized_keeps_first():
    first = chat(("user", "Hello,  World!"), ("assistant", "Hi."), id="1", group="a")
    exact = chat(("user", "Hello,  World!"), ("assistant", "Hi."), id="2", group="b")  # metadata differs only
    near = chat(("user", "hello world"), ("assistant", "hi"), id="3")
    other = chat(("user", "hello world"), ("assistant", "bye"), id="4")
    kept, stats = dedup_rows(rows_of(first, exact, near, other))
    assert [row.data["id"] for row in kept] == ["1", "4"]
    assert (stats.num_exact_duplicates, stats.num_normalized_duplicates) == (1, 1)
    assert normalize_text("  It's   A\tTEST_case, ok?! ") == "its a testcase ok"


def test_split_is_group_aware_and_deterministic():
    datas = [chat(("user", f"q{i}"), ("assistant", f"a{i}"), group=f"g{i % 97}", id=str(i)) for i in range(3000)]
    splits = split_rows(rows_of(*datas), (0.8, 0.1, 0.1), seed=0)
    where = defaultdict(set)
    for name, rows in splits.items():
        for row in rows:
            where[row.data["group"]].add(name)
    assert all(len(names) == 1 for names in where.values())  # no group in two splits
    assert sum(len(rows) for rows in splits.values()) == 3000
    assert all(splits[name] for name in ("train", "validation", "test"))
    again = split_rows(rows_of(*datas), (0.8, 0.1, 0.1), seed=0)
    assert {k: [r.data["id"] for r in v] for k, v in again.items()} == {k: [r.data["id"] for r in v]
                                                                       for k, v in splits.items()}
    assert split_rows(rows_of(*datas), (0.8, 0.1, 0.1), seed=1) != splits  # the seed re-draws the split


def test_split_key_fallbacks_and_ratio_edges():
    assert split_key({"group": "g", "id": "i"}) == "group:g"
    assert split_key({"id": "i"}) == "id:i"
    assert split_key(chat(("user", "u"), ("assistant", "a"))).startswith("content:")
    assert all(assign_split(f"k{i}", (1.0, 0.0, 0.0)) == "train" for i in range(200))
    assert all(assign_split(f"k{i}", (0.0, 0.0, 1.0)) == "test" for i in range(200))
    assert parse_ratios("0.7,0.2,0.1") == (0.7, 0.2, 0.1)
    for bad in ("0.9,0.1", "0.5,0.5,0.5", "a,b,c", "1.2,-0.1,-0.1"):
        with pytest.raises(ValueError, match="ratios"):
            parse_ratios(bad)


@pytest.fixture
def synth_file(write_jsonl):
    rows = generate_rows(400, seed=5)
    rows += [rows[0], rows[1]]  # exact duplicates
    near = json.loads(json.dumps(rows[2]))
    near["messages"][1]["content"] = near["messages"][1]["content"].upper() + "!!"
    near["id"] = "near-dup"
    return write_jsonl("synth.jsonl", rows + [near])


def test_prepare_writes_content_hashed_splits_and_manifest(tmp_path, synth_file):
    result = prepare_dataset([synth_file], tmp_path / "out", ratios=(0.8, 0.1, 0.1), schema_path=SCHEMA_PATH)
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest == result.manifest and manifest["version"] == result.version
    input_hash = hashlib.sha256(synth_file.read_bytes()).hexdigest()
    assert manifest["inputs"] == [{"path": str(synth_file), "sha256": input_hash, "rows": 403}]
    counts = manifest["counts"]
    assert counts["input_rows"] == 403 and counts["exact_duplicates"] >= 2 and counts["normalized_duplicates"] >= 1
    assert counts["train"] + counts["validation"] + counts["test"] == counts["output_rows"] == 403 - counts[
        "exact_duplicates"] - counts["normalized_duplicates"]
    groups = {}
    for name, path in split_files(tmp_path / "out").items():
        payload = path.read_bytes()
        digest = hashlib.sha256(payload).hexdigest()
        assert path.name == f"{name}-{digest[:12]}.jsonl" and manifest["outputs"][name]["sha256"] == digest
        for line in payload.decode().splitlines():
            group = json.loads(line)["group"]
            assert groups.setdefault(group, name) == name  # no group in two splits
    expected_version = hashlib.sha256("".join(f"{n}:{manifest['outputs'][n]['sha256']}\n"
                                              for n in ("train", "validation", "test")).encode()).hexdigest()
    assert result.version == expected_version

    # Same inputs -> byte-identical outputs and version, wherever they are written.
    again = prepare_dataset([synth_file], tmp_path / "again", ratios=(0.8, 0.1, 0.1), schema_path=SCHEMA_PATH)
    assert again.version == result.version
    assert (tmp_path / "again" / MANIFEST_NAME).read_bytes() == (tmp_path / "out" / MANIFEST_NAME).read_bytes()
    assert prepare_dataset([synth_file], tmp_path / "seeded", split_seed=7).version != result.version


@pytest.fixture
def leaky_file(write_jsonl):
    return write_jsonl("leaky.jsonl", [
        chat(("user", "my key is AKIAIOSFODNN7EXAMPLE"), ("assistant", "rotate it"), group="a"),
        chat(("user", "clean"), ("assistant", "ok"), group="b"),
        chat(("user", "mail me: bob@example.org"), ("assistant", "ok"), group="c"),
    ])


def test_pii_report_keeps_rows(tmp_path, leaky_file):
    result = prepare_dataset([leaky_file], tmp_path / "out", ratios=(1.0, 0.0, 0.0))
    report = json.loads((tmp_path / "out" / PII_REPORT_NAME).read_text())
    assert report["num_findings"] == 2 and report["by_kind"] == {"aws_access_key": 1, "email": 1}
    assert {(f["line"], f["kind"]) for f in report["findings"]} == {(1, "aws_access_key"), (3, "email")}
    assert result.manifest["counts"]["train"] == 3 and result.manifest["counts"]["pii_dropped"] == 0


def test_pii_drop_removes_rows(tmp_path, leaky_file):
    result = prepare_dataset([leaky_file], tmp_path / "out", ratios=(1.0, 0.0, 0.0), pii_action="drop")
    assert result.manifest["counts"]["pii_dropped"] == 2 and result.manifest["counts"]["train"] == 1
    train = split_files(tmp_path / "out")["train"].read_text()
    assert "AKIA" not in train and "bob@" not in train


def test_pii_fail_raises_after_writing_the_report(tmp_path, leaky_file):
    with pytest.raises(ValueError, match="2 secret/PII finding"):
        prepare_dataset([leaky_file], tmp_path / "out", pii_action="fail")
    assert (tmp_path / "out" / PII_REPORT_NAME).is_file()
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_prepare_rejects_bad_data_and_options(tmp_path, write_jsonl):
    bad = write_jsonl("bad.jsonl", [chat(("user", "u"), ("assistant", "a")), chat(("user", "u"))])
    with pytest.raises(ValueError, match=f"{bad}:2: messages"):
        prepare_dataset([bad], tmp_path / "out")
    with pytest.raises(ValueError, match="pii action"):
        prepare_dataset([bad], tmp_path / "out", pii_action="ignore")
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        split_files(tmp_path / "nowhere")
