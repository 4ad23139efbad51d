"""End to end: `glmtune eval` scores the shared SFT run against its base on a small suite,
`glmtune release` records that eval directory, `verify` is clean, then names a changed
checkpoint byte."""

from __future__ import annotations

import json

import yaml

from glmtune.cli import main
from tests.release.conftest import copy_run

SUITE = {
    "name": "release-e2e", "version": "2",
    "decoding": {"max_new_tokens": 8, "batch_size": 8, "max_tool_rounds": 1},
    "sets": [{"name": "tickets", "run_split": "validation", "limit": 2,
              "scorers": [{"type": "task_success", "fields": ["product", "severity", "next_action"]},
                          "reference_loss"]}],
    "gates": [{"name": "reference loss improves", "metric": "tickets/reference_loss/loss", "rule": "improves"},
              {"name": "p95 latency", "metric": "operations/latency/p95_s", "rule": "max", "threshold": 60}],
}


def test_release_of_a_real_eval(sft_source, tmp_path, capsys):
    run = copy_run(sft_source, tmp_path / "run")
    suite, eval_dir = tmp_path / "suite.yaml", tmp_path / "eval"
    suite.write_text(yaml.safe_dump(SUITE, sort_keys=False))
    assert main(["eval", str(suite), "--base", str(run), "--candidate", str(run), "--out", str(eval_dir),
                 "--device", "cpu"]) == 0, capsys.readouterr()
    scorecard = json.loads((eval_dir / "scorecard.json").read_text())
    capsys.readouterr()

    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    capsys.readouterr()
    m = json.loads((run / "release.json").read_text())
    assert m["eval"]["candidate"] == "candidate" and m["eval"]["evaluated_artifact"] == "checkpoint"
    assert (m["eval"]["suite"]["name"], m["eval"]["suite"]["version"]) == ("release-e2e", "2")
    assert m["eval"]["path"] == str(eval_dir) and m["eval"]["passed"]
    assert m["prompt"]["chat_template_sha256"] == m["tokenizer"]["chat_template"]["sha256"]
    assert {s["id"] for s in m["eval"]["scores"]} == {x["id"] for x in scorecard["metrics"]}
    triggers = {t["metric"]: t for t in m["rollback"]["triggers"]}
    assert set(triggers) == {"tickets/reference_loss/loss", "operations/latency/p95_s"}
    loss = next(s for s in m["eval"]["scores"] if s["id"] == "tickets/reference_loss/loss")["values"]
    # Lower is better: 10% above the candidate's loss, or the base's loss if that comes first.
    assert triggers["tickets/reference_loss/loss"]["op"] == ">"
    assert abs(triggers["tickets/reference_loss/loss"]["threshold"]
               - min(loss["candidate"] * 1.1, loss["base"])) < 1e-5 * loss["base"]

    # The eval directory lies beside the run: its root is absolute, read with --allow-outside.
    assert main(["release", "verify", str(run / "release.json"), "--allow-outside"]) == 0
    capsys.readouterr()
    weights = run / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    assert main(["release", "verify", str(run / "release.json"), "--allow-outside"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1] if " DRIFT " in line] == ["checkpoint"]
    assert "model.safetensors sha256 changed" in lines[1]
