"""`glmtune eval --nproc-per-node 2` on gloo: the same scorecard as one process.

Each model is built on the meta device, parallelized by the training plan and loaded sharded
(`glmtune/eval/sharded.py`); the batches are split over the ranks (`answering.run_rows`). The
reference is `glmtune eval` in one process on the same weights. Every per-example output
(text, transcript, tool calls, finish, the reference loss), every task metric and the serving
metrics (MTP acceptance: every rank runs every row's MTP layer in step) must be equal; latency,
tokens/s and memory are the only figures allowed to differ, and each rank's peak memory must be
reported.

  * dp 2: the full fine-tuning run's export (FSDP2 over both ranks), through `--nproc-per-node 2`
    (eval's own torchrun launch, from a fresh interpreter);
  * ep 2: the LoRA run's adapter on its base (routed experts split over the two ranks, their
    adapters with them; FSDP2 over the dense weights), on two ranks forked as torchrun starts them.

The one-process references and the ep 2 ranks run in processes forked from the gloo fork server
(tests/distributed/forked_cli.py), glmtune imported there once.

The suite has an odd number of batches per set (rank 1 then takes idle steps in the last round)
and the tickets set a reference loss; the general-text loss runs on both ranks, and so do the
preference set's pair log-probabilities.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from glmtune.data.synthetic import SCHEMA_PATH, generate_rows
from glmtune.data.synthetic_preferences import generate_preference_rows
from tests.distributed.forked_cli import commands_in_forks
from tests.train.run_helpers import TWO_STEPS, WITH_EXPORT, shared_run

BUNDLED = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "eval_support_json"
REPO = Path(__file__).resolve().parents[2]


def _suite(directory: Path) -> Path:
    rows = generate_rows(200, seed=11)
    calls = [r for r in rows if r["category"] == "tool_call"][:2]
    plain = [r for r in rows if not r.get("tools")][:3]  # five rows in batches of 2: rank 1 idles in the third
    (directory / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in calls + plain))
    (directory / "general_text.txt").write_text((BUNDLED / "general_text.txt").read_text())
    pairs = generate_preference_rows(2, seed=11)  # the preference scorer: every rank scores each pair in step
    (directory / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    suite = {
        "name": "sharded", "version": "1",
        "decoding": {"max_new_tokens": 10, "batch_size": 2, "max_tool_rounds": 1},
        "tools": {"timeout_s": 30, "functions": {"lookup_order": "glmtune.data.synthetic:lookup_order"}},
        "sets": [
            {"name": "tickets", "run_split": "validation", "limit": 5,
             "scorers": [{"type": "task_success", "fields": ["product", "severity", "next_action"]},
                         {"type": "format", "schema": str(SCHEMA_PATH)}, "reference_loss"]},
            {"name": "tools", "path": "tools.jsonl", "scorers": ["tool_execution", "task_success"]},
            {"name": "pairs", "path": "pairs.jsonl", "scorers": ["preference"]},
        ],
        "general_text": {"path": "general_text.txt", "max_tokens": 192, "window": 64},
        "gates": [{"name": "reference loss", "metric": "tickets/reference_loss/loss", "rule": "max",
                   "threshold": 100.0}],
    }
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _argv(suite: Path, base: Path, candidate: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", str(suite), "--base", str(base), "--candidate", str(candidate), "--out", str(out),
            "--device", "cpu", "--json", *extra]


def _eval(suite: Path, base: Path, candidate: Path, out: Path, *extra: str) -> dict:
    """`python -m glmtune eval`, as a user starts it: with `--nproc-per-node`, its own torchrun launch."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "glmtune", *_argv(suite, base, candidate, out, *extra)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((out / "scorecard.json").read_text())


def _eval_in_forks(nproc: int, suite: Path, base: Path, candidate: Path, out: Path, *extra: str) -> dict:
    """The same command on `nproc` processes forked from the gloo fork server (tests/distributed/forked_cli.py:
    glmtune imported once, not per interpreter; N ranks as torchrun starts them), exiting 0."""
    commands_in_forks({out: _argv(suite, base, candidate, out, *extra)}, nproc)
    return json.loads((out / "scorecard.json").read_text())


def _without_operations(card: dict) -> tuple[list, list, list, list]:
    metrics = [m for m in card["metrics"]
               if not m["id"].startswith("operations/") or m["id"].startswith("operations/serving/")]
    examples = [{**e, "outputs": {label: {k: v for k, v in out.items() if k != "latency_s"}
                                  for label, out in e["outputs"].items()}} for e in card["examples"]]
    return metrics, card["fields"], examples, [(g["name"], g["passed"]) for g in card["gates"]]


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    return _suite(tmp_path_factory.mktemp("suite"))


@pytest.mark.parametrize("recipe, extra, layout", [
    ("tiny/sft_support_json", WITH_EXPORT, []),
    ("tiny/lora_support_json", TWO_STEPS, ["--parallel.ep", "2"]),
], ids=["dp2-full", "ep2-lora"])
def test_two_ranks_give_the_scorecard_of_one_process(shared_results, suite, tmp_path, recipe, extra, layout):
    run_dir = shared_run(shared_results, *extra, recipe=recipe).run_dir
    one = _eval_in_forks(1, suite, run_dir, run_dir, tmp_path / "one")
    if layout:  # the ranks as torchrun starts them
        two = _eval_in_forks(2, suite, run_dir, run_dir, tmp_path / "two", *layout)
    else:  # `--nproc-per-node 2`: eval's own launch of torchrun, from a fresh interpreter
        two = _eval(suite, run_dir, run_dir, tmp_path / "two", "--nproc-per-node", "2", *layout)
    assert _without_operations(two) == _without_operations(one)
    mtp = next(m for m in two["metrics"] if m["id"] == "operations/serving/mtp_acceptance")
    assert all(v is not None for v in mtp["by_category"]["all"]["values"].values()) and mtp["by_category"]["all"]["n"]
    tool_rows = [e for e in one["examples"] if e["set"] == "tools"]
    assert tool_rows and all(e["outputs"]["candidate"]["finish"] for e in tool_rows)
    for label, ops in two["operations"].items():
        assert ops["ranks"] == 2 and len(ops["peak_memory_gib_per_rank"]) == 2, label
        assert all(p is not None and p > 0 for p in ops["peak_memory_gib_per_rank"]), label
        assert ops["layout"]["ep"] == (2 if layout else 1)
        assert ops["requests"] == one["operations"][label]["requests"]
    assert "peak_memory_gib_per_rank" not in one["operations"]["candidate"]
