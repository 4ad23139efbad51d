"""`glmtune release diff A B`: a LoRA release followed by a full fine-tune that names it as
--previous; what changed, as the human table and as JSON."""

from __future__ import annotations

import copy
import json
import re

import pytest

from glmtune.cli import main
from glmtune.release.diff import diff_releases, report_lines
from glmtune.release.manifest import FORMAT
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


# A manifest edited by hand: every field the diff reads is type-checked. A wrong type anywhere is
# exit 2 and one line naming the file and the field, never a traceback.

def _manifest(exact: float) -> dict:
    sha = lambda byte: byte * 32  # noqa: E731
    return {
        "format": FORMAT, "id": "0123456789abcdef", "created": "2026-01-02T03:04:05+00:00",
        "run": {"path": "run", "run_id": "run-1", "name": "tiny", "method": "lora", "shipped": ["adapter"]},
        "base": {"name_or_path": "tiny", "preset": "tiny", "seed": 0, "revision": None, "revision_source": "preset",
                 "config_sha256": sha("ab"), "weights_sha256": sha("cd"), "num_tensors": 12},
        "engine": {"name": "vllm", "version": "0.11.0", "caveats": ["a caveat"]},
        "tokenizer": {"chat_template": {"source": "tokenizer_config.json", "sha256": sha("ef")},
                      "files": {"tokenizer.json": sha("01")}},
        "prompt": {"chat_template_sha256": sha("ef"), "system_prompt_sha256": None},
        "eval": {"suite": {"name": "support", "version": "1", "sha256": sha("11"),
                           "sets": [{"name": "tickets", "sha256": sha("22"), "rows": 16}]},
                 "decoding": {"max_new_tokens": 96, "temperature": 0.0, "stop_strings": []},
                 "passed": True, "allowed_failed_gates": False,
                 "gates": [{"name": "exact improves", "model": "candidate", "passed": True, "value": exact}],
                 "scores": [{"id": "tickets/task_success/exact", "values": {"base": 0.1, "candidate": exact}}]},
        "config": {"resolved": {"train": {"max_steps": 4}, "peft": {"method": "lora", "r": 8}}},
        "data": {"manifest": {"sha256": sha("33"), "train_conversations": 10, "validation_conversations": 2,
                              "train_rows": 10, "train_tokens": 1000},
                 "sources": {"train": {"path": "train.jsonl", "sha256": sha("44")}},
                 "contract": {"sha256": sha("55")}, "json_schema": {"sha256": None}, "pii": {"policy": "refuse"},
                 "approval": {"approved_by": "Ana", "note": "ok", "at": "2026-01-02T03:04:05+00:00"}},
        "environment": {"glmtune": {"version": "0.1.0", "commit": "abc123"}, "libraries": {"torch": "2.13"}},
        "previous": {"id": "fedcba9876543210", "sha256": sha("66")},
        "rollback": {"margin": 0.1, "to": None,
                     "triggers": [{"metric": "tickets/task_success/exact", "category": "all", "op": "<",
                                   "threshold": round(exact * 0.9, 6)}],
                     "untriggered": [{"metric": "t/acc", "category": "all", "source": "gate: g", "reason": "why"}]},
        "artifacts": [{"name": "adapter", "root": "adapter", "kind": "dir", "num_files": 2, "size": 2048,
                       "files": [{"path": "adapter_model.safetensors", "sha256": sha("77"), "size": 2000},
                                 {"path": "adapter_config.json", "sha256": sha("88"), "size": 48}]}],
        "signature": None,
    }


def _paths(value, path=""):
    """(dotted path, parent, key) of every field below `value`, parents first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, item in items:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        yield here, value, key
        yield from _paths(item, here)


_WRONG = [{}, [], "text", 1.5, True, None, [None], [1, "x"], {"k": []}]


def _set(manifest: dict, path: str, value) -> dict:
    manifest = copy.deepcopy(manifest)
    for here, parent, key in _paths(manifest):
        if here == path:
            parent[key] = value
            return manifest
    raise AssertionError(path)


@pytest.fixture
def pair(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_manifest(0.4)))
    return a, b


def test_every_wrong_type_anywhere_is_one_line_naming_the_field(pair):
    a, b = pair
    good = _manifest(0.6)
    b.write_text(json.dumps(good))
    report_lines(diff_releases(a, b))  # the valid pair diffs
    refused, problems = 0, []
    for path, _, _ in list(_paths(good)):
        if path in ("format",):
            continue
        for wrong in _WRONG:
            b.write_text(json.dumps(_set(good, path, wrong)))
            try:
                report_lines(diff_releases(a, b))  # read whole (a caveat list), or a type the field allows
            except ValueError as exc:
                refused += 1
                message = str(exc)
                if not (message.startswith(f"B {b}: ") and "\n" not in message
                        and re.search(rf"(^|: ){re.escape(path)}(\.|\[| is )", message.split(": ", 1)[1])):
                    problems.append((path, wrong, message))
            except Exception as exc:  # noqa: BLE001 - the point: nothing but a ValueError
                problems.append((path, wrong, f"{type(exc).__name__}: {exc}"))
    assert not problems, problems[:10]
    assert refused > 150  # the sweep did reach the typed fields


@pytest.mark.parametrize("path, wrong, message", [
    ("base", [], "base is a list, expected an object"),
    ("eval", "text", "eval is a string, expected an object"),
    ("eval.scores", {}, "eval.scores is an object, expected a list"),
    ("eval.scores[0]", None, "eval.scores[0] is null, expected an object"),
    ("eval.scores[0].values", [0.6], "eval.scores[0].values is a list, expected an object"),
    ("eval.scores[0].values.candidate", {"v": 0.6}, "eval.scores[0].values.candidate is an object, expected a "
                                                    "string, a number, a boolean or null"),
    ("eval.scores[0].id", None, "eval.scores[0].id is null, expected a string"),
    ("eval.suite.sets", [None], "eval.suite.sets[0] is null, expected an object"),
    ("eval.gates[0].name", ["x"], "eval.gates[0].name is a list, expected a string"),
    ("rollback.triggers[0].threshold", "0.4", "rollback.triggers[0].threshold is a string, expected a number"),
    ("rollback.triggers[0].threshold", True, "rollback.triggers[0].threshold is a boolean, expected a number"),
    ("rollback.triggers[0].metric", None, "rollback.triggers[0].metric is null, expected a string"),
    ("rollback.untriggered[0].reason", 1, "rollback.untriggered[0].reason is a number, expected a string"),
    ("artifacts[0].num_files", "2", "artifacts[0].num_files is a string, expected a number"),
    ("artifacts[0].files", {"a": 1}, "artifacts[0].files is an object, expected a list"),
    ("artifacts[0].files[1].sha256", 7, "artifacts[0].files[1].sha256 is a number, expected a string"),
    ("artifacts[0].name", ["adapter"], "artifacts[0].name is a list, expected a string"),
    ("data.approval", ["Ana"], "data.approval is a list, expected an object"),
    ("environment.libraries", "torch", "environment.libraries is a string, expected an object"),
    ("config.resolved", [1], "config.resolved is a list, expected an object"),
    ("tokenizer.chat_template.sha256", {}, "tokenizer.chat_template.sha256 is an object, expected a string"),
])
@pytest.mark.parametrize("side", ["A", "B"])
def test_release_diff_names_the_file_and_the_field(pair, capsys, path, wrong, message, side):
    a, b = pair
    b.write_text(json.dumps(_manifest(0.6)))
    bad = a if side == "A" else b
    bad.write_text(json.dumps(_set(_manifest(0.4 if side == "A" else 0.6), path, wrong)))
    assert main(["release", "diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err == f"glmtune release: error: {side} {bad}: {message}\n", err
