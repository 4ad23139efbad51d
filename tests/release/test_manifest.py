"""`glmtune release RUN_DIR --eval EVAL_DIR`: what release.json records for a full fine-tune and a
LoRA run, checked against the files themselves."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import yaml

from glmtune.cli import main
from glmtune.data.chat_template import load_chat_template
from glmtune.models.registry import hf_dir_identity
from glmtune.release import release_id


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_artifact_files(manifest: dict, manifest_dir: Path) -> None:
    """Every recorded file's size and sha256 are the file's; a directory artifact lists all its files but
    hidden ones (the output record glmtune writes into each output directory among them)."""
    for artifact in manifest["artifacts"]:
        root = Path(artifact["root"]) if Path(artifact["root"]).is_absolute() else manifest_dir / artifact["root"]
        base = root.parent if artifact["kind"] == "file" else root
        for entry in artifact["files"]:
            assert entry["size"] == (base / entry["path"]).stat().st_size, entry
            assert entry["sha256"] == _sha(base / entry["path"]), entry
        if artifact["kind"] == "dir":
            found = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
            on_disk = sorted(rel for rel in found if not any(part.startswith(".") for part in rel.split("/")))
            assert [f["path"] for f in artifact["files"]] == on_disk
        assert artifact["size"] == sum(f["size"] for f in artifact["files"])


def test_full_finetune_manifest(sft_run, capsys):
    run, eval_dir = sft_run
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0
    out = capsys.readouterr().out
    m = json.loads((run / "release.json").read_text())
    assert out.startswith(f"release {m['id']} of run ")
    assert m["format"] == "glmtune.release/1" and m["id"] == release_id(m)
    assert m["run"]["run_id"] == json.loads((run / "run.json").read_text())["run_id"]
    assert m["run"] | {"path": ".", "method": "full", "shipped": ["checkpoint"]} == m["run"]

    # The base: the preset's initial weights the run wrote, hashed as adapters and scorecards name bases.
    identity = hf_dir_identity(run / "base")
    assert m["base"]["preset"] == "tiny" and m["base"]["revision"] is None and m["base"]["path"] == "base"
    assert "local directory" in m["base"]["revision_source"]
    assert (m["base"]["config_sha256"], m["base"]["weights_sha256"]) == (identity["config_sha256"],
                                                                         identity["weights_sha256"])
    names = [a["name"] for a in m["artifacts"]]
    assert names == ["checkpoint", "base", "tokenizer", "data_manifest", "data", "pii_report", "config",
                     "run_record", "eval", "model_card"]
    _check_artifact_files(m, run)
    checkpoint = next(a for a in m["artifacts"] if a["name"] == "checkpoint")
    assert checkpoint["root"] == "hf" and "model.safetensors" in [f["path"] for f in checkpoint["files"]]

    # Tokenizer and template: the files that ship with hf/, and the template the eval rendered with.
    template_sha = hashlib.sha256(load_chat_template(run / "hf").encode()).hexdigest()
    assert m["tokenizer"]["chat_template"] == {"source": "chat_template.jinja", "sha256": template_sha}
    assert m["tokenizer"]["files"]["tokenizer.json"] == _sha(run / "hf" / "tokenizer.json")
    scorecard = json.loads((eval_dir / "scorecard.json").read_text())
    assert m["prompt"] == scorecard["prompt"]
    # The engine as pinned, and the command that serves the checkpoint (facts checked against vLLM 0.34.0).
    assert m["engine"] == {"name": "vllm", "version": "0.11.0", "facts_checked": "0.34.0", "caveats": [],
                           "serve_command": f"vllm serve {(run / 'hf').resolve()}"}

    # The eval: suite identity, each set's hash, the scores of category "all", the gates.
    ev = m["eval"]
    assert ev["scorecard_sha256"] == _sha(eval_dir / "scorecard.json") and ev["path"] == str(eval_dir)
    assert (ev["suite"]["name"], ev["suite"]["version"], ev["suite"]["sha256"]) == (
        "support-json", "3", _sha(eval_dir / "suite.yaml"))
    assert {s["name"]: s["sha256"] for s in ev["suite"]["sets"]} == {
        "tickets": _sha(eval_dir / "sets" / "tickets.jsonl"), "refusal": _sha(eval_dir / "sets" / "refusal.jsonl")}
    exact = next(s for s in ev["scores"] if s["id"] == "tickets/task_success/exact")
    assert exact["values"] == {"base": 0.0, "candidate": 0.4} and exact["delta"] == {"candidate": 0.4}
    assert ev["candidate"] == "candidate" and ev["evaluated_artifact"] == "checkpoint"
    assert ev["passed"] and not ev["allowed_failed_gates"]
    assert [g["passed"] for g in ev["gates"]] == [True] * 4

    # Data provenance, config, versions.
    data = m["data"]
    assert data["manifest"]["sha256"] == _sha(run / "data_manifest.json")
    assert data["manifest"]["train_conversations"] == json.loads((run / "data_manifest.json").read_text())[
        "train_conversations"]
    assert data["sources"]["synthetic"] == {"kind": "support_tickets", "rows": 240, "seed": 0}
    assert data["contract"]["sha256"] and data["approval"] is None
    assert m["config"]["resolved"] == yaml.safe_load((run / "config.yaml").read_text())
    assert m["config"]["sha256"] == _sha(run / "config.yaml")
    assert m["environment"]["libraries"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert m["environment"]["glmtune"]["version"] == "0.1.0"
    assert m["previous"] is None and m["rollback"]["to"] is None

    # Rollback defaults from the gates: the candidate's value by the 10% margin, or the gate's bar.
    triggers = {t["metric"]: t["expression"] for t in m["rollback"]["triggers"]}
    assert triggers == {"tickets/task_success/exact": "tickets/task_success/exact < 0.36",
                        "tickets/format/critical_failures": "tickets/format/critical_failures > 0",
                        "tickets/tool_execution/success": "tickets/tool_execution/success < 0.9",
                        "general_text/loss/loss": "general_text/loss/loss > 8.9"}  # base 8.4 + budget 0.5


def test_lora_manifest(lora_run, tmp_path, capsys):
    run, eval_dir = lora_run
    out = tmp_path / "releases" / "r1.json"  # outside the run: roots are absolute
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "sglang", "--engine-version", "0.5.2",
                 "--approved-by", "Ana Ops", "--approval-note", "canary 5% first", "--out", str(out),
                 "--rollback", "tickets/task_success/exact@tool_call<0.1", "--rollback", "p95_latency_s>2.0",
                 "--rollback", "tickets/task_success/exact <= 0.3", "--rollback-margin", "0.2"]) == 0
    assert "approval  Ana Ops" in capsys.readouterr().out
    m = json.loads(out.read_text())
    assert m["run"]["method"] == "lora" and m["run"]["shipped"] == ["adapter", "adapter_per_expert"]
    assert m["eval"]["evaluated_artifact"] == "adapter"
    assert m["run"]["path"] == str(run)
    names = [a["name"] for a in m["artifacts"]]
    assert names[:3] == ["adapter", "adapter_per_expert", "base"] and "checkpoint" not in names
    _check_artifact_files(m, out.parent)
    adapter = {f["path"] for f in m["artifacts"][0]["files"]}
    assert adapter == {"README.md", "adapter_config.json", "adapter_model.safetensors", "glmtune_adapter.json"}
    # The adapter's base: the identity the run recorded when it trained.
    assert m["base"]["weights_sha256"] == json.loads((run / "run.json").read_text())["base"]["weights_sha256"]
    assert m["tokenizer"]["path"] == str(run / "base")
    # SGLang: the per-expert adapter, the rank, every target module, shared experts unfused.
    assert m["engine"]["name"] == "sglang" and m["engine"]["version"] == "0.5.2"
    assert m["engine"]["serve_command"] == (
        f"python -m sglang.launch_server --model-path {(run / 'base').resolve()} --enable-lora --lora-paths "
        f"adapter={(run / 'adapter_per_expert').resolve()} --max-lora-rank 8 --lora-target-modules down_proj "
        "gate_proj kv_a_proj_with_mqa o_proj q_a_proj q_b_proj up_proj --disable-shared-experts-fusion")
    assert m["engine"]["caveats"] == [] and m["engine"]["facts_checked"] == "0.5.23"
    approval = m["data"]["approval"]
    assert approval == {"approved_by": "Ana Ops", "note": "canary 5% first", "at": m["created"]}

    triggers = {(t["metric"], t["category"]): t for t in m["rollback"]["triggers"]}
    assert m["rollback"]["margin"] == 0.2
    assert triggers["tickets/task_success/exact", "all"]["expression"] == "tickets/task_success/exact <= 0.3"
    assert triggers["tickets/task_success/exact", "all"]["source"] == "--rollback"  # replaced the gate's default
    assert triggers["tickets/task_success/exact", "tool_call"]["eval_value"] == 0.2
    p95 = triggers["p95_latency_s", "all"]
    assert (p95["op"], p95["threshold"], p95["eval_value"], p95["unit"]) == (">", 2.0, 0.4, "seconds")
    assert triggers["tickets/tool_execution/success", "all"]["threshold"] == 0.8  # 1.0 less the 0.2 margin
