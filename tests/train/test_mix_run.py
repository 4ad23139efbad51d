"""The replay recipe (recipes/tiny/cpt_domain_text_replay.yaml) trains: the realized mix of every logged
window and each source's validation loss are in the metrics, the replay's data under the run's data/,
and a run resumed from a mid-run checkpoint gives the uninterrupted run's per-step losses and mix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.train.run_helpers import command_in_fork, printed

RECIPE = "recipes/tiny/cpt_domain_text_replay.yaml"
FLAGS = ["--train.max_steps", "4", "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "0",
         "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.val_every", "2",
         "--train.val_steps", "1", "--train.log_every", "1", "--data.replay.synthetic.rows", "160"]


def _train(run_dir, cache_dir, *extra: str) -> subprocess.CompletedProcess:
    """The run (it must finish) on a process forked from the gloo fork server (run_helpers.command_in_fork)."""
    command = [sys.executable, "-m", "glmtune", "train", RECIPE, *FLAGS, "--logging.run_dir", str(run_dir),
               "--data.cache_dir", str(cache_dir), *extra]
    return command_in_fork(command, run_dir)


def _records(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    done = _train(root / "run", root / "cache")
    return root, done.stdout


def test_the_mix_and_each_sources_validation_are_logged(straight):
    root, stdout = straight
    records = _records(root / "run")
    assert sorted(records) == [1, 2, 3, 4]
    for record in records.values():
        shares = record["mix/domain"], record["mix/replay"]
        assert sum(shares) == pytest.approx(1.0)
        # 4 rows a step: a step's share is within a domain row's targets (up to 255 of ~250-800) of 0.2
        assert 0.0 < shares[1] < 0.6
    for step in (2, 4):
        assert records[step]["val_loss"] > 0 and records[step]["val_loss/replay"] > 0
        assert records[step]["val_loss/replay"] != records[step]["val_loss"]
    assert "val_loss/replay" not in records[1]
    assert printed(stdout, "data: replay mix: 0.80 domain / 0.20 replay of the training target tokens")
    assert printed(stdout, "validation loss before training, replay:")
    manifest = json.loads((root / "run" / "data_manifest.json").read_text())
    assert manifest["mix"] == {"sources": ["domain", "replay"], "weights": [0.8, 0.2], "unit": "target tokens"}
    assert manifest["kind"] == "text" and manifest["replay"]["train_conversations"] > 0
    assert (root / "run" / "data" / "replay" / "pii_report.json").is_file()


def test_the_realized_mix_over_the_run_is_the_weight(straight):
    """Over the whole run the replay's share of the targets is within one row's targets of 0.2."""
    records = _records(straight[0] / "run")
    targets = [records[s]["supervised_tokens"] for s in sorted(records)]
    replay = sum(records[s]["mix/replay"] * n for s, n in zip(sorted(records), targets))
    assert abs(replay / sum(targets) - 0.2) <= 255 / sum(targets)


def test_a_resumed_mixed_run_matches_the_uninterrupted_one(straight, tmp_path):
    root, _ = straight
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")  # what a run stopped after step 2 left
    done = _train(run_dir, root / "cache", "--checkpoint.resume", "auto")
    assert printed(done.stdout, "at step 2")
    expected, actual = _records(root / "run"), _records(run_dir)
    assert sorted(actual) == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "supervised_tokens", "mix/domain", "mix/replay", "val_loss", "val_loss/replay")
    for step in (3, 4):  # trained after the resume: the same rows, so the same floats
        assert [actual[step].get(k) for k in keys] == [expected[step].get(k) for k in keys], step
