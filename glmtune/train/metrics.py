"""Training metrics: one JSON object per optimizer step in `metrics.jsonl`, TensorBoard
scalars, the experiment trackers (W&B: `logging.wandb`; MLflow: `logging.mlflow`), and
per-MoE-layer routing statistics.

Every sink receives the same step records: what metrics.jsonl holds, a tracker holds too.
MLflow gets the resolved config as params (dotted keys: `optim.lr`) and each numeric field of
a record as a metric at its step, through `MlflowClient` (no global active run: a notebook's
own MLflow run is left alone). A `file:` tracking URI is MLflow's local store, no server;
MLflow 3 keeps it behind MLFLOW_ALLOW_FILE_STORE, which glmtune sets (unless you set it) when
the URI you chose is one.

Routing statistics per MoE layer, from the (token, expert) pairs each expert received in
the step, summed over every micro-batch and rank:
  * `max_load`: the busiest expert's pairs over the mean (1.0 = perfectly balanced; the
    busiest expert bounds an expert-parallel step's time);
  * `mean_load`: pairs per expert (tokens x top-k / experts): the scale `max_load` is relative to;
  * `load_cv`: standard deviation over mean of the per-expert counts (0 = balanced);
  * `idle_experts`: the share of experts that received no token;
  * `router_entropy`: entropy of the expert-load distribution divided by log(E)
    (1.0 = uniform, 0 = all tokens on one expert).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from glmtune.io.json_file import json_lines
from glmtune.io.text_limits import clipped

_MLFLOW_BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics) per call
_MLFLOW_PARAM_CHARS = 6000  # the longest param value MLflow stores


def routing_stats(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    counts = tokens_per_expert.double()
    total = counts.sum().item()
    num_experts = counts.numel()
    if total == 0:
        return {"max_load": 0.0, "mean_load": 0.0, "load_cv": 0.0, "idle_experts": 0.0, "router_entropy": 0.0}
    mean = total / num_experts
    share = counts / total
    entropy = -(share[share > 0] * share[share > 0].log()).sum().item()
    return {
        "max_load": counts.max().item() / mean,
        "mean_load": mean,
        "load_cv": counts.std(unbiased=False).item() / mean,
        "idle_experts": (counts == 0).double().mean().item(),
        "router_entropy": entropy / math.log(num_experts) if num_experts > 1 else 1.0,
    }


class MetricsWriter:
    """Appends step records to JSONL (rank 0) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, metrics_file: str, tensorboard: bool, enabled: bool = True,
                 wandb_project: str | None = None, run_name: str | None = None,
                 config: dict[str, Any] | None = None, mlflow_uri: str | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / metrics_file
        self.tb = None
        self.wandb = None
        if enabled and wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("logging.wandb is set but the wandb package is not installed "
                                 "(pip install wandb), or set logging.wandb: null") from None
            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(run_dir))
        self.mlflow = MlflowSink(mlflow_uri, run_name or "glmtune", config or {}) if enabled and mlflow_uri else None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.tb_dir = run_dir / "tensorboard" if enabled and tensorboard else None
        self.purge_step: int | None = None

    def kept_lines(self, step: int) -> list[bytes]:
        """The lines of the metrics file that a resume from `step` keeps (those of steps up to it).

        The file is read as untrusted (`glmtune.io.json_file.json_lines`): a last line cut short by
        a kill is dropped; any other line that is not a step record glmtune writes (an object with
        an integer step) is a ValueError naming the file and line, before anything is rewritten."""
        if not (self.enabled and step > 0 and os.path.lexists(self.path)):
            return []
        kept = []
        for number, record, line in json_lines(self.path, "metrics file", cut_tail=True):
            logged = record.get("step")
            if type(logged) is not int or logged < 0:
                raise ValueError(f"metrics file {self.path}:{number}: step is {clipped(repr(logged), 40)}, not a step "
                                 "number; not a record glmtune writes (remove the line to resume)")
            if logged <= step:
                kept.append(line)
        return kept

    def truncate_after(self, step: int) -> None:
        """On resume, forget records of steps the killed run logged after its last checkpoint
        (in metrics.jsonl, rewritten atomically, and in TensorBoard through the writer's purge_step);
        a fresh run (step 0) starts an empty file."""
        self.purge_step = step + 1
        if not (self.enabled and os.path.lexists(self.path)):
            return
        kept = self.kept_lines(step)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self.mlflow is not None:
            self.mlflow.log(record)
        if self.tb is None and self.tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self.purge_step)
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.close()


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: dotted keys, values as YAML would show them (lists and dicts as
    JSON), each cut to the length MLflow stores."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = text[:_MLFLOW_PARAM_CHARS]
    return params


class MlflowSink:
    """One MLflow run per training process (as W&B's): experiment and run named after the run."""

    def __init__(self, uri: str, name: str, config: dict[str, Any]) -> None:
        try:
            import mlflow
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ValueError("logging.mlflow is set but the mlflow package is not installed "
                             "(pip install mlflow-skinny), or set logging.mlflow: null") from None
        if uri.startswith("file:"):  # MLflow 3 asks for this opt-in before it writes its local file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric = mlflow.entities.Metric
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, v) for k, v in flat_params(config).items()]
        for start in range(0, len(params), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + _MLFLOW_BATCH])

    def log(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(key, float(value), now, record["step"]) for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
