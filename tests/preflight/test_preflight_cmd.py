"""`glmtune preflight` end to end: both tiny recipes pass all ten checks; the report, exit status,
output safety and the skips that follow an early failure."""

from __future__ import annotations

import json

import pytest

from glmtune.cli import main
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from tests.preflight.conftest import SFT


@pytest.mark.parametrize("name", ["sft", "lora"])
def test_tiny_recipe_passes_all_ten_checks(name, request):
    done = request.getfixturevalue(f"{name}_done")
    checks = done.report.get("checks", [])
    failed = [(c["number"], c["status"], c["message"]) for c in checks if c["status"] != "pass"]
    assert done.status == 0, failed
    assert [c["number"] for c in done.report["checks"]] == list(range(1, 11)) and not failed
    assert done.report["passed"] and done.report["exit_status"] == 0
    markdown = (done.out / "preflight.md").read_text()
    assert "**PASS: all ten checks pass**" in markdown
    assert "| 10 | multi-process run of the scaled layout | PASS" in markdown
    assert "| routed_experts |" in markdown and "| prompt | reference | base | trained |" in markdown
    # evidence behind the verdicts
    assert done.check(7)["evidence"]["killed"].startswith("SIGKILL")
    assert done.check(7)["evidence"]["tolerance"] == "exact: CPU, float32"
    assert done.check(8)["evidence"]["logits"]["max_abs_difference"] <= 1e-4
    assert done.check(10)["evidence"]["layout"] == "2 processes: dp 2"
    assert done.check(6)["evidence"]["paths"]["indexer"]["state"].startswith("frozen")
    groups = done.check(4)["evidence"]["inventory"]["groups"]
    assert groups["routed_experts"]["trainable"] > 0 and (name == "sft") == (groups["router"]["trainable"] > 0)


def test_non_empty_out_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["preflight", str(SFT), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["preflight", str(SFT), "--out", str(out), "--overwrite"]) == 2  # not an earlier preflight's
    assert "holds no preflight.json" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_missing_shard_fails_check_2_and_skips_the_runs(ckpt, tmp_path):
    (ckpt / "model-00003-of-00008.safetensors").unlink()
    out = tmp_path / "out"
    args = ["preflight", str(SFT), "--model.name_or_path", str(ckpt), "--data.tokenizer", str(TINY_TOKENIZER_DIR),
            "--out", str(out)]
    assert main(args) == 1
    report = json.loads((out / "preflight.json").read_text())
    status = {c["number"]: c["status"] for c in report["checks"]}
    assert status == {1: "pass", 2: "fail", 3: "pass", 4: "pass", **{n: "skip" for n in range(5, 11)}}
    assert "model-00003-of-00008.safetensors: missing" in report["checks"][1]["message"]
    assert all("check 2 (shards) fail" in c["skip_reason"] for c in report["checks"][4:])  # 7-10 via 5
    # --overwrite replaces an earlier preflight's output
    (ckpt / "model-00005-of-00008.safetensors").unlink()
    assert main([*args, "--overwrite"]) == 1
    report = json.loads((out / "preflight.json").read_text())
    assert "model-00005-of-00008.safetensors" in json.dumps(report["checks"][1]["evidence"]["problems"])
