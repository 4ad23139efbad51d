"""`glmtune release` and symlinks in what it records: a link out of RUN_DIR (a file, a directory,
an artifact's root) is refused in one line naming it, before anything is written; a link that
stays inside RUN_DIR is followed and recorded under its own path, and verifies clean."""

from __future__ import annotations

import hashlib
import json

import pytest

from glmtune.cli import main
from tests.release.eval_fixture import make_eval_dir

ENGINE = ["--engine", "vllm==0.11.0"]


@pytest.mark.parametrize("link, target_kind", [("data/extra.jsonl", "file"), ("hf/extra", "dir"),
                                                ("pii_report.json", "file")])
def test_link_out_of_the_run_is_refused(sft_run, tmp_path, capsys, link, target_kind):
    run, eval_dir = sft_run
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text('{"secret": 1}\n')
    target = outside if target_kind == "dir" else outside / "secret.jsonl"
    if (run / link).exists():
        (run / link).unlink()  # pii_report.json: the artifact's root itself becomes the link
    (run / link).symlink_to(target, target_is_directory=target_kind == "dir")
    assert main(["release", str(run), "--eval", str(eval_dir), *ENGINE]) == 2
    err = capsys.readouterr().err
    name = link.split("/")[-1]
    assert err.count("\n") == 1 and f"{name}{'/' if target_kind == 'dir' else ''} leads out of " in err, err
    assert "a release follows links only where they stay inside RUN_DIR" in err
    assert not (run / "release.json").exists()


def test_link_inside_the_run_is_followed(sft_run, capsys):
    run, _ = sft_run
    eval_dir = make_eval_dir(run / "eval", run)  # inside the run: every root relative
    train = next((run / "data").glob("train-*.jsonl"))
    (run / "data" / "alias.jsonl").symlink_to(train)
    assert main(["release", str(run), "--eval", str(eval_dir), *ENGINE]) == 0
    m = json.loads((run / "release.json").read_text())
    data = {f["path"]: f["sha256"] for f in next(a for a in m["artifacts"] if a["name"] == "data")["files"]}
    assert data["alias.jsonl"] == data[train.name] == hashlib.sha256(train.read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(["release", "verify", str(run / "release.json")]) == 0, capsys.readouterr().out
