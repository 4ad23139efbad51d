"""Wall time, GPU-hours and cost of a run, with a stated failure budget.

  compute      tokens to train / (tokens/s per GPU x GPUs)
  checkpoints  saves x (bytes the busiest rank writes / write bandwidth per GPU); an
               asynchronous save blocks only for its device-to-host staging (`--stage-gbps`)
  restarts     expected restarts x (restart time + half a checkpoint interval of lost steps);
               by default one restart per started day of wall time (`--restarts` overrides)
GPU-hours = GPUs x (compute + checkpoints + restarts); cost = GPU-hours x price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureBudget:
    write_gbps: float = 1.0  # checkpoint write bandwidth per GPU (GB/s), shared filesystem
    stage_gbps: float = 20.0  # device-to-host copy of an asynchronous save (GB/s per GPU)
    restart_minutes: float = 20.0  # requeue, process start, checkpoint load, warm-up and compile
    restarts: int | None = None  # None: one per started day of wall time


@dataclass
class RunCost:
    tokens: int
    steps: int
    gpus: int
    tokens_per_s_per_gpu: float
    compute_h: float
    checkpoint_h: float
    restart_h: float
    restarts: int
    price_per_gpu_hour: float | None

    @property
    def wall_h(self) -> float:
        return self.compute_h + self.checkpoint_h + self.restart_h

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.wall_h

    @property
    def cost(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpu_hours * self.price_per_gpu_hour

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "steps": self.steps, "gpus": self.gpus,
                "tokens_per_s_per_gpu": _sig(self.tokens_per_s_per_gpu),
                "compute_hours": _sig(self.compute_h), "checkpoint_hours": _sig(self.checkpoint_h),
                "restart_hours": _sig(self.restart_h), "restarts": self.restarts,
                "wall_hours": _sig(self.wall_h), "gpu_hours": _sig(self.gpu_hours),
                "price_per_gpu_hour": self.price_per_gpu_hour,
                "cost": None if self.cost is None else _sig(self.cost)}


def _sig(value: float) -> float:
    """Six significant digits: tiny runs take microhours, GLM-5 runs thousands of GPU-hours."""
    return float(f"{value:.6g}")


def run_cost(tokens: int, steps: int, gpus: int, tokens_per_s_per_gpu: float, checkpoint_bytes_per_rank: int,
             saves: int, async_save: bool, budget: FailureBudget, price: float | None) -> RunCost:
    compute = tokens / (tokens_per_s_per_gpu * gpus) / 3600
    bandwidth = budget.stage_gbps if async_save else budget.write_gbps
    per_save = checkpoint_bytes_per_rank / (bandwidth * 1e9) / 3600
    checkpoints = saves * per_save
    wall = compute + checkpoints
    restarts = budget.restarts if budget.restarts is not None else max(1, math.ceil(wall / 24))
    interval = compute / max(saves, 1)  # steps between saves, in hours
    restart = restarts * (budget.restart_minutes / 60 + interval / 2)
    return RunCost(tokens, steps, gpus, tokens_per_s_per_gpu, compute, checkpoints, restart, restarts, price)
