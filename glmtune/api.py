"""The Python API of the common path: load a recipe, override keys, train, evaluate (docs/python-api.md).

    from glmtune import api
    cfg = api.load_config("tiny/sft_support_json", {"train.max_steps": 20, "logging.run_dir": "runs/demo"})
    result = api.train(cfg)                        # what `glmtune train` does, in this process
    scorecard, out = api.evaluate("recipes/tiny/eval_support_json.yaml", base=result.run_dir / "base",
                                  candidate=result.run_dir)

Each function is the command's own code path, called without the command line: `load_config`
is `glmtune train RECIPE --key value ...`'s parsing (the same types, checks and messages);
`train` is `glmtune train`'s run (`glmtune.train.run.run_training`); `evaluate` is
`glmtune eval`'s (`glmtune.eval.evaluate.run_eval`). User errors are ValueError or
FileNotFoundError with the command's one-line message. For several processes, start the script
with torchrun: every rank calls `train`, as `glmtune train --nproc-per-node` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.config import JobConfig, config_to_dict
from glmtune.config import load_config as _load_recipe
from glmtune.eval.evaluate import run_eval
from glmtune.io.json_file import json_lines
from glmtune.train.run import run_training

__all__ = ["JobConfig", "TrainResult", "config_to_dict", "evaluate", "load_config", "train"]

# run_training's exit statuses (glmtune train's): 0 finished, 3 failed (reported), 130 interrupted
_STATUS = {0: "finished", 3: "failed", 130: "interrupted"}


def _override_tokens(overrides: Mapping[str, Any] | Sequence[str]) -> list[str]:
    """`{"train.max_steps": 2}` -> `["--train.max_steps", "2"]` (JSON is YAML: lists and dicts pass as
    flow collections, None as null); a sequence is taken as command-line tokens already."""
    if not isinstance(overrides, Mapping):
        return list(overrides)
    tokens = []
    for key, value in overrides.items():
        tokens += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return tokens


def load_config(recipe: str | Path | None, overrides: Mapping[str, Any] | Sequence[str] = ()) -> JobConfig:
    """A recipe (a path, or a bundled name such as "tiny/sft_support_json"; None: the defaults) with
    dotted-key overrides, type-checked as `glmtune train` parses it (the cross-field checks that need
    the model, parallel degrees and batch sizes, run in `train` before anything is allocated).

    Args:
        overrides: {"optim.lr": 2e-5, "train.max_steps": 20}, or command-line tokens
            ["--optim.lr", "2e-5"]. An unknown key or a wrong type is a ValueError naming it.
    """
    return _load_recipe(recipe, _override_tokens(overrides))


@dataclass
class TrainResult:
    """What `train` leaves: the run directory and the step records it logged."""

    status: str  # "finished", "failed" or "interrupted"
    exit_code: int  # glmtune train's: 0, 3, 130
    run_dir: Path  # config.yaml, metrics.jsonl, checkpoints/, hf/ or adapter/ (README.md)
    metrics: list[dict[str, Any]]  # metrics.jsonl's records, one per logged step


def train(config: JobConfig, *, overwrite: bool = False) -> TrainResult:
    """Train `config` in this process, as `glmtune train` does (`overwrite`: its --overwrite).

    Returns the result whatever the status; a refused config raises ValueError before anything
    is written."""
    code = run_training(config, overwrite=overwrite)
    run_dir = Path(config.logging.run_dir)
    path = run_dir / config.logging.metrics_file
    metrics = [record for _, record, _ in json_lines(path, "metrics file", cut_tail=True)] if path.is_file() else []
    return TrainResult(_STATUS.get(code, f"exit {code}"), code, run_dir, metrics)


def evaluate(suite: str | Path, base: str | Path, candidate: str | Path, out: str | Path | None = None, *,
             overwrite: bool = False, device: str = "auto", merged: bool = False) -> tuple[dict[str, Any], Path]:
    """Score `candidate` against `base` on `suite`, as `glmtune eval SUITE --base B --candidate C`.

    base, candidate: a run directory, an HF directory or adapter, a preset, or a server URL
    (docs/eval.md). Returns (the scorecard, as scorecard.json holds it, the eval directory);
    `scorecard["passed"]` is whether every release gate passed."""
    return run_eval(suite, base, candidate, out, overwrite=overwrite, device=device, merged=merged)
