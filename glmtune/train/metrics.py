"""Training metrics: one JSON object per optimizer step in `metrics.jsonl`, TensorBoard
scalars, and per-MoE-layer routing statistics.

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
from pathlib import Path
from typing import Any

import torch


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
                 config: dict[str, Any] | None = None) -> None:
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
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.tb_dir = run_dir / "tensorboard" if enabled and tensorboard else None
        self.purge_step: int | None = None

    def truncate_after(self, step: int) -> None:
        """On resume, forget records of steps the killed run logged after its last checkpoint
        (in metrics.jsonl, and in TensorBoard through the writer's purge_step)."""
        self.purge_step = step + 1
        if not (self.enabled and self.path.is_file()):
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                pass  # a line cut short by a kill
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
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
