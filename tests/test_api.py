"""glmtune.api, the Python API of docs/python-api.md: the tiny recipe trained for 2 steps through
`load_config` + `train` (in its own process, as a notebook would) logs the same losses as
`glmtune train` with the same keys, and `evaluate` scores it; a bad key is one ValueError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from glmtune import api
from tests.train.run_helpers import SMALL, TWO_STEPS, env, losses, shared_run

SUITE = {
    "name": "api", "version": "1",
    "decoding": {"max_new_tokens": 8, "batch_size": 8, "max_tool_rounds": 1},
    "sets": [{"name": "tickets", "run_split": "validation", "limit": 2, "scorers": ["reference_loss"]}],
    "gates": [{"name": "loss improves", "metric": "tickets/reference_loss/loss", "rule": "improves"}],
}

SCRIPT = """
import json, sys
from glmtune import api
overrides, suite, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = api.load_config("tiny/sft_support_json", overrides)
result = api.train(cfg)
scorecard, eval_dir = api.evaluate(suite, base=result.run_dir, candidate=result.run_dir, out=out, device="cpu")
print(json.dumps({"status": result.status, "run_dir": str(result.run_dir), "metrics": result.metrics,
                  "passed": scorecard["passed"], "eval_dir": str(eval_dir),
                  "metric_ids": [m["id"] for m in scorecard["metrics"]]}))
"""


def _as_mapping(tokens: list[str]) -> dict[str, object]:
    """SMALL's command-line flags as the API's {key: value} (YAML-parsed as the CLI parses them)."""
    return {tokens[i][2:]: yaml.safe_load(tokens[i + 1]) for i in range(0, len(tokens), 2)}


def test_two_steps_through_the_api_equal_the_cli(shared_results, tmp_path):
    reference = shared_run(shared_results, *TWO_STEPS)
    # the HF export (for evaluate) is written after the last step: the losses are the reference's
    overrides = _as_mapping([*SMALL, *TWO_STEPS]) | {"logging.run_dir": str(tmp_path / "run"),
                                                    "data.cache_dir": str(tmp_path / "cache"),
                                                    "checkpoint.export_hf": True}
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump(SUITE, sort_keys=False))
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(overrides), str(suite), str(tmp_path / "eval")],
                          env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "finished" and result["run_dir"] == str(tmp_path / "run")
    api_losses = {r["step"]: r["loss"] for r in result["metrics"]}
    assert api_losses == losses(reference.run_dir) and sorted(api_losses) == [1, 2]  # bit-identical
    assert result["metric_ids"][0] == "tickets/reference_loss/loss"
    assert (Path(result["eval_dir"]) / "scorecard.json").is_file()


def test_overrides_are_checked_as_on_the_command_line():
    cfg = api.load_config("tiny/sft_support_json", {"train.max_steps": 3, "optim.betas": [0.9, 0.95]})
    assert cfg.train.max_steps == 3 and list(cfg.optim.betas) == [0.9, 0.95]
    assert api.load_config("tiny/sft_support_json", ["--train.max_steps", "4"]).train.max_steps == 4
    with pytest.raises(ValueError, match="train.no_such_key"):
        api.load_config("tiny/sft_support_json", {"train.no_such_key": 1})
    with pytest.raises(ValueError, match="train.max_steps"):
        api.load_config("tiny/sft_support_json", {"train.max_steps": "many"})
