"""`glmtune release diff A B`: a LoRA release followed by a full fine-tune that names it as
--previous; what changed, as the human table and as JSON."""

from __future__ import annotations

import json

from glmtune.cli import main
from tests.release.eval_fixture import make_eval_dir


def test_diff_of_chained_releases(lora_run, sft_source, tmp_path, capsys):
    from tests.release.conftest import copy_run

    lora, lora_eval = lora_run
    sft = copy_run(sft_source, tmp_path / "sft")
    sft_eval = make_eval_dir(tmp_path / "sft-eval", sft, exact=0.6)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["release", str(lora), "--eval", str(lora_eval), "--engine", "vllm==0.11.0", "--out", str(a)]) == 0
    assert main(["release", str(sft), "--eval", str(sft_eval), "--engine", "vllm==0.12.0", "--out", str(b),
                 "--previous", str(a), "--approved-by", "Ana"]) == 0
    capsys.readouterr()
    release_a, release_b = json.loads(a.read_text()), json.loads(b.read_text())
    assert release_b["previous"]["id"] == release_a["id"] and release_b["rollback"]["to"] == release_a["id"]
    assert release_b["previous"]["path"] == "a.json"  # beside it: relative

    assert main(["release", "diff", str(a), str(b), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chained"] and (result["a"]["id"], result["b"]["id"]) == (release_a["id"], release_b["id"])
    changes = {(c["section"], c["key"]): c for c in result["changes"]}
    assert changes["engine", "version"]["a"] == "0.11.0" and changes["engine", "version"]["b"] == "0.12.0"
    assert changes["artifacts", "adapter"]["detail"] == "removed"
    assert changes["artifacts", "checkpoint"]["detail"] == "added"
    assert "adapter_model.safetensors" not in str(changes.get(("artifacts", "base")))  # the same preset base
    exact = changes["scores", "tickets/task_success/exact [candidate]"]
    assert (exact["a"], exact["b"]) == (0.4, 0.6) and abs(exact["delta"] - 0.2) < 1e-12
    assert ("scores", "tickets/tool_execution/success [candidate]") not in changes  # 1.0 in both
    assert (changes["config", "peft.method"]["a"], changes["config", "peft.method"]["b"]) == ("lora", "none")
    assert changes["config", "train.max_steps"]["b"] == 4
    assert changes["data", "approval.approved_by"]["b"] == "Ana"
    assert changes["rollback", "to"]["b"] == release_a["id"]
    assert changes["rollback", "tickets/task_success/exact@all"]["b"] == "< 0.54"
    assert changes["release", "run.method"]["b"] == "full"
    assert "base" in result["unchanged"] and "prompt" in result["unchanged"] and "suite" in result["unchanged"]

    assert main(["release", "diff", str(a), str(b)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2] == "B names A as its previous release"
    assert any(line.split()[:2] == ["scores", "tickets/task_success/exact"] and line.endswith("+0.2")
               for line in table), table
    assert any(line.split()[:2] == ["artifacts", "checkpoint"] and line.endswith("added") for line in table)
    assert table[-1].startswith("unchanged: base, ")

    assert main(["release", "diff", str(b), str(b)]) == 0
    same = capsys.readouterr().out.splitlines()
    assert same[2] == "B does not name A as its previous release" and same[3] == "no differences"
