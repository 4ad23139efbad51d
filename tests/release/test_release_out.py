"""`glmtune release --out`: `--overwrite` replaces only a release manifest, and inside a run directory
the manifest goes only to RUN_DIR/release.json or under RUN_DIR/releases/: a checkpoint's trainer
state, metrics.jsonl or the lock are never replaced (one line, nothing changed). The Makefile's
demo re-runs release with --overwrite into the run directory: that keeps working."""

from __future__ import annotations

import json
import shutil

import pytest

from glmtune.cli import main
from glmtune.io.run_lock import LOCK_FILE
from tests.release.eval_fixture import make_eval_dir
from tests.tree_snapshot import changes, snapshot

ENGINE = ["--engine", "vllm==0.11.0", "--allow-failed-gates"]


@pytest.fixture
def run_with_checkpoints(sft_source, tmp_path):
    run = shutil.copytree(sft_source, tmp_path / "run", symlinks=True)
    return run, make_eval_dir(tmp_path / "eval", run)


def _release(capsys, run, eval_dir, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["release", str(run), "--eval", str(eval_dir), *ENGINE, *extra])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("place", ["checkpoints/STEP/trainer_state.json", "checkpoints/STEP", "metrics.jsonl",
                                   "tensorboard/events.json", "samples.json", "trainable.json", LOCK_FILE,
                                   "release.json/x", "eval/release.json", "releases"])
def test_release_never_writes_over_a_runs_own_files(run_with_checkpoints, tmp_path, capsys, place):
    run, eval_dir = run_with_checkpoints
    step = sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1]
    target = run / place.replace("STEP", step)
    before = snapshot(tmp_path)
    code, err = _release(capsys, run, eval_dir, "--out", str(target), "--overwrite")
    rel = place.replace("STEP", step)
    assert code == 2 and err == (
        f"glmtune release: error: --out {target} is inside the glmtune run directory {run} ({rel}: the run's, and "
        f"glmtune release writes {run}/release.json or {run}/release.md or {run}/releases/NAME); choose another path (--overwrite never "
        "replaces a run's files)"), err
    assert changes(before, snapshot(tmp_path)) == []


def test_release_replaces_its_own_manifest_and_nothing_else(run_with_checkpoints, tmp_path, capsys):
    run, eval_dir = run_with_checkpoints
    assert _release(capsys, run, eval_dir)[0] == 0  # RUN_DIR/release.json, as `make demo` writes it
    first = json.loads((run / "release.json").read_text())
    code, err = _release(capsys, run, eval_dir)
    assert code == 2 and "already exists; pass --overwrite to replace it" in err, err
    assert _release(capsys, run, eval_dir, "--overwrite", "--approved-by", "me")[0] == 0  # as `make demo` re-runs
    assert json.loads((run / "release.json").read_text())["id"] != first["id"]
    assert _release(capsys, run, eval_dir, "--out", str(run / "releases" / "v2.json"))[0] == 0
    assert _release(capsys, run, eval_dir, "--out", str(run / "releases" / "v2.json"), "--overwrite")[0] == 0
    elsewhere = tmp_path / "notes.json"
    elsewhere.write_text('{"format": "my notes"}\n')
    before = snapshot(tmp_path)
    for flags, exists in (([], "already exists, and "), (["--overwrite"], "")):
        code, err = _release(capsys, run, eval_dir, "--out", str(elsewhere), *flags)
        assert code == 2 and err == (
            f"glmtune release: error: --out {elsewhere} {exists}is a file glmtune release did not write: it is not a "
            "release manifest; --overwrite replaces only what glmtune release wrote: choose another path, or move it "
            "away"), err
    assert changes(before, snapshot(tmp_path)) == []
    shutil.copy(run / "release.json", elsewhere)  # a release manifest there: replaced
    assert _release(capsys, run, eval_dir, "--out", str(elsewhere), "--overwrite")[0] == 0
