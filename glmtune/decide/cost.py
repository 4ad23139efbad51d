"""The training alternative's price beside the verdict: `--recipe RECIPE` planned by `glmtune plan`.

The figures are the plan's own (`glmtune.plan.assemble.build_plan`, docs/plan.md): the recipe's
layout and GPU count, and from a measured speed (`--throughput RUN_DIR|metrics.jsonl|benchmark
lines`, or `--tflops-per-gpu X` measured on `--measured-gpu`) its wall time, GPU-hours and, with
`--price-per-gpu-hour`, its cost, per GPU kind (`--gpu`, default the plan's: H100 and H200), with
the plan's speed source and assumptions named. A plan takes speed from a measurement, never a
datasheet, so `--recipe` without one is refused, and so is any of these options without `--recipe`.
The recipe's data is not read (as `glmtune plan --no-data`): reading it would fill the tokenization
cache, and decide writes nothing outside --out; the run is `train.max_steps` steps of the global
batch, each row `data.packed_sequence_size` tokens, as the plan counts it without its data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glmtune.config import load_config
from glmtune.plan.assemble import PlanOptions, build_plan
from glmtune.plan.hardware import gpu_spec
from glmtune.plan.throughput_source import Measurement, read_measurement


@dataclass
class CostOptions:
    recipe: str | None = None
    throughput: str | None = None
    tflops_per_gpu: float | None = None
    measured_gpu: str | None = None
    gpus: list[str] = field(default_factory=list)  # --gpu; empty: the plan's default
    price_per_gpu_hour: float | None = None

    def check(self) -> None:
        """ValueError (one sentence, naming the option) before anything runs."""
        given = [f"--{name.replace('_', '-')}" for name in ("throughput", "tflops_per_gpu", "measured_gpu",
                                                            "price_per_gpu_hour") if getattr(self, name) is not None]
        given += ["--gpu"] if self.gpus else []
        if self.recipe is None:
            if given:
                raise ValueError(f"{given[0]} prices the training alternative of --recipe RECIPE; add --recipe")
            return
        if (self.throughput is None) == (self.tflops_per_gpu is None):
            raise ValueError("--recipe is priced from a measured speed: give --throughput RUN_DIR|metrics.jsonl or "
                             "--tflops-per-gpu X (one of them; docs/plan.md)")
        if self.measured_gpu is not None and self.tflops_per_gpu is None:
            raise ValueError("--measured-gpu describes --tflops-per-gpu; a --throughput source names its GPU itself")
        for option, value in (("--tflops-per-gpu", self.tflops_per_gpu), ("--price-per-gpu-hour",
                                                                         self.price_per_gpu_hour)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{option} must be a finite number > 0, got {value}")
        for key in self.gpus + ([self.measured_gpu] if self.measured_gpu else []):
            gpu_spec(key)
        if self.tflops_per_gpu is not None:
            measured = self.measured_gpu or (self.gpus or PlanOptions().gpus)[0]
            peak = gpu_spec(measured).bf16_tflops
            if self.tflops_per_gpu > peak:
                raise ValueError(f"--tflops-per-gpu {self.tflops_per_gpu:g} is above the dense bf16 peak of {measured} "
                                 f"({peak:g} TFLOP/s), which no run reaches; give the model TFLOP/s per GPU measured")

    def measurement(self) -> Measurement:
        if self.throughput is not None:
            return read_measurement(self.throughput)
        measured = self.measured_gpu or (self.gpus or PlanOptions().gpus)[0]
        return Measurement("--tflops-per-gpu", self.tflops_per_gpu, gpu_spec(measured).bf16_tflops, 1)


def plan_cost(options: CostOptions) -> dict | None:
    """The cost line's figures (None without --recipe): the recipe, the plan's speed source and,
    per GPU kind, the plan's time entry (GPUs, wall hours, GPU-hours, cost) and assumption."""
    if options.recipe is None:
        return None
    cfg = load_config(options.recipe)
    plan_options = PlanOptions(price_per_gpu_hour=options.price_per_gpu_hour, measurement=options.measurement(),
                               read_data=False)
    if options.gpus:
        plan_options.gpus = list(options.gpus)
    report = build_plan(cfg, options.recipe, plan_options)
    return {"recipe": options.recipe, "model": report["model"], "layout": report["layout"]["describe"],
            "run": report["run"], "speed_source": report["throughput"]["source"],
            "gpus": [{"gpu": g["gpu"], "fits": g["recipe_layout"]["fits"], **g["time"],
                      "assumption": g["time_assumption"]} for g in report["gpus"]]}


def cost_line(cost: dict) -> list[str]:
    """The cost beside the verdict, one line per GPU kind."""
    lines = []
    for g in cost["gpus"]:
        price = ("no price (--price-per-gpu-hour)" if g["cost"] is None else
                 f"cost {g['cost']:,.0f}" if g["cost"] >= 100 else f"cost {g['cost']:,.2f}")
        fits = "" if g["fits"] else " (the recipe's layout does not fit this GPU's memory)"
        lines.append(f"fine-tuning by {cost['recipe']} on {g['gpus']} x {g['gpu']}: {g['wall_hours']:,.4g} h wall, "
                     f"{g['gpu_hours']:,.4g} GPU-hours, {price}{fits}; speed: {cost['speed_source']}")
    return lines
