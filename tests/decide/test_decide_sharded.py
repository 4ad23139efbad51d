"""`glmtune decide --nproc-per-node 2` on gloo (eval's launcher and layout): the decision of one
process. The base (the tiny run's base/) is laid out over two ranks (dp 2) and answers its three
arms there, then the run (hf/) as the alternative; every arm's answers, metrics and gate results,
the verdict and its exit status equal the one-process decision's, and only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from tests.decide.helpers import TICKET_SCORERS, decision_of, small_suite, trained_run, write_jsonl
from tests.distributed.forked_cli import commands_in_forks, ended

REPO = Path(__file__).resolve().parents[2]


def _argv(suite, run_dir, docs, out, *extra: str) -> list[str]:
    return ["decide", str(suite), "--base", str(run_dir), "--examples", str(run_dir), "--shots", "1", "--docs",
            str(docs), "--passages", "1", "--compare", f"{run_dir},name=trained", "--out", str(out), "--device",
            "cpu", "--json", *extra]


def _decide(suite, run_dir, docs, out, *extra: str) -> tuple[int, dict]:
    """`python -m glmtune decide`, as a user starts it (with `--nproc-per-node`, eval's torchrun launch)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "glmtune", *_argv(suite, run_dir, docs, out, *extra)],
                          capture_output=True, text=True, env=env, timeout=600)
    return _decided(done.returncode, done.stdout, done.stderr, out)


def _decide_forked(suite, run_dir, docs, out) -> tuple[int, dict]:
    """The one-process decision in a process forked from the gloo fork server (glmtune imported there once)."""
    commands_in_forks({out: _argv(suite, run_dir, docs, out)}, stderr_apart=True, check=False)
    return _decided(*ended(out), out)


def _decided(code: int, stdout: str, stderr: str, out) -> tuple[int, dict]:
    assert code in (0, 1), stdout[-3000:] + stderr[-6000:]
    assert json.loads(stdout)["verdict"]["exit_code"] == code
    return code, decision_of(out)


def _comparable(decision: dict) -> tuple:
    card = decision["scorecard"]
    metrics = [m for m in card["metrics"] if not m["id"].startswith("operations/")
               or m["id"].startswith("operations/serving/")]
    answers = [(e["set"], e["id"], {label: (o["text"], o["finish"], o["passed"]) for label, o in e["outputs"].items()},
                e["added"]) for e in card["examples"]]
    return metrics, answers, [(g["name"], g["model"], g["passed"]) for g in card["gates"]], decision["verdict"]


def test_two_ranks_give_the_decision_of_one_process(shared_results, tmp_path):
    run_dir = trained_run(shared_results)
    write_jsonl(tmp_path / "catalog.jsonl", generate_doc_questions(seed=0)[:3])
    write_documents(tmp_path / "docs", seed=0)
    suite = small_suite(tmp_path, [{"name": "tickets", "run_split": "validation", "limit": 3,
                                    "scorers": TICKET_SCORERS},
                                   {"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]}],
                        [{"metric": "tickets/task_success/exact", "rule": "min", "threshold": 0.2}])
    suite.write_text(suite.read_text().replace("batch_size: 8", "batch_size: 2"))  # rank 1 idles in a round
    one_code, one = _decide_forked(suite, run_dir, tmp_path / "docs", tmp_path / "one")
    two_code, two = _decide(suite, run_dir, tmp_path / "docs", tmp_path / "two", "--nproc-per-node", "2")
    assert two_code == one_code == 1
    assert _comparable(two) == _comparable(one)
    for label, ops in two["scorecard"]["operations"].items():
        assert ops["ranks"] == 2 and ops["layout"]["ep"] == 1, label
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
