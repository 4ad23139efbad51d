"""Terminal escapes in options and manifest fields are printed escaped (`\\x1b`) by `release`,
`release verify` and `release diff`, on stdout and stderr: a forged green "ok" line or a cleared
screen is shown as text. `--json` is escaped by json.dumps and reads back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from glmtune.cli import main
from glmtune.release.artifacts import record_artifact
from glmtune.release.manifest import FORMAT, release_id

ESC = "\x1b"
FORGED = "\x1b[2K\r\x1b[32mrelease 0000000000000000: clean\x1b[0m"  # erase the line, print a green verdict
SHOWN = "\\x1b[2K\\x0d\\x1b[32mrelease 0000000000000000: clean\\x1b[0m"


def _out(capsys) -> tuple[str, str]:
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_release_prints_options_and_scorecard_fields_escaped(sft_run, tmp_path, capsys):
    run, eval_dir = sft_run
    scorecard = json.loads((eval_dir / "scorecard.json").read_text())
    scorecard["suite"]["name"] = f"support{FORGED}"  # the suite's own hashes are of suite.yaml: still intact
    (eval_dir / "scorecard.json").write_text(json.dumps(scorecard))
    argv = ["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0", "--approved-by", f"Ana{FORGED}",
            "--approval-note", FORGED]
    assert main(argv) == 0
    out, err = _out(capsys)
    assert ESC not in out + err and f"approval  Ana{SHOWN}" in out and f"suite support{SHOWN} v3" in out, out
    m = json.loads((run / "release.json").read_text())
    assert m["data"]["approval"]["approved_by"] == f"Ana{FORGED}"  # recorded as given; JSON escapes it
    assert ESC not in (run / "release.json").read_text()

    # A field of --previous in an error message.
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps({**m, "id": FORGED}))
    assert main([*argv[:6], "--out", str(tmp_path / "next.json"), "--previous", str(previous)]) == 2
    out, err = _out(capsys)
    assert ESC not in out + err and f"does not match its id {SHOWN}" in err, err
    # A scorecard's set name in a refusal (its rows file is named after it).
    scorecard["suite"]["sets"][0]["name"] = f"tickets{FORGED}"
    (eval_dir / "scorecard.json").write_text(json.dumps(scorecard))
    assert main([*argv[:6], "--out", str(tmp_path / "next.json")]) == 2
    out, err = _out(capsys)
    assert ESC not in out + err and f"sets/tickets{SHOWN}.jsonl" in err, err


def _manifest(rel: Path, name: str, approved_by: str, metric: str) -> Path:
    root = rel / f"model{FORGED}"
    root.mkdir(parents=True)
    (root / f"weights{ESC}[31m.bin").write_bytes(b"w")
    artifact, _ = record_artifact(f"model{FORGED}", root, "dir", "a model", rel)
    manifest = {"format": FORMAT, "id": None, "created": FORGED, "artifacts": [artifact], "signature": None,
                "data": {"approval": {"approved_by": approved_by}},
                "eval": {"scores": [{"id": metric, "values": {"candidate": 0.5 if approved_by else 0.25}}]}}
    manifest["id"] = release_id(manifest)
    (rel / name).write_text(json.dumps(manifest))
    return rel / name


def test_verify_and_diff_print_manifest_fields_escaped(tmp_path, capsys):
    a = _manifest(tmp_path / "a", "a.json", "", f"tickets/exact{FORGED}")
    b = _manifest(tmp_path / "b", "b.json", f"Ana{FORGED}", f"tickets/exact{FORGED}")
    assert main(["release", "verify", str(a)]) == 0
    out, err = _out(capsys)
    assert ESC not in out + err and f"model{SHOWN}  ok       model{SHOWN} (1 file, 1 B)" in out, out
    (tmp_path / "a" / f"model{FORGED}" / f"weights{ESC}[31m.bin").write_bytes(b"x")  # drift names the file
    assert main(["release", "verify", str(a)]) == 1
    out, err = _out(capsys)
    assert ESC not in out + err and "weights\\x1b[31m.bin sha256 changed" in out, out

    assert main(["release", "diff", str(a), str(b)]) == 0
    out, err = _out(capsys)
    assert ESC not in out + err and f"tickets/exact{SHOWN} [candidate]" in out, out
    assert f"A: release {json.loads(a.read_text())['id']} ({SHOWN})" in out and "Ana\\x1b[2K\\x0d" in out

    # --json: escaped by json.dumps, the text itself unchanged once parsed.
    main(["release", "verify", str(a), "--json"])
    out, _ = _out(capsys)
    assert ESC not in out and "\\u001b" in out and json.loads(out)["artifacts"][0]["name"] == f"model{FORGED}"
    main(["release", "diff", str(a), str(b), "--json"])
    out, _ = _out(capsys)
    assert ESC not in out and f"tickets/exact{FORGED} [candidate]" in [c["key"] for c in json.loads(out)["changes"]]
