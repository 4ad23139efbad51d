"""One recipe's whole plan as a dict: floor, the recipe's own layout per GPU, fits, data, time, cost.

The pieces are computed by the modules beside this one; this module only decides what to
compute for the command's options and puts the results in one JSON-ready structure
(`plan_report.py` prints it). The model's family answers through its spec
(`glmtune/models/registry.py`): vocabulary size and FLOPs per token.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from glmtune.config import JobConfig
from glmtune.config.validate import limit_errors, planned_saves
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import model_spec
from glmtune.plan import cost as run_cost
from glmtune.plan.data_tokens import EpochTokens, epoch_tokens, unreadable_data
from glmtune.plan.floor import adapter_parameters, floor_table, model_parameters, recipe_row
from glmtune.plan.hardware import gpu_spec
from glmtune.plan.model_state import build_meta_model, memory_model_of
from glmtune.plan.planner import degrees_for, plan_memory
from glmtune.plan.search import layout_config, smallest_fit
from glmtune.plan.throughput_source import Measurement, tokens_per_s_per_gpu
from glmtune.train.precision import resolve_precision

GIB = 2**30


@dataclass
class PlanOptions:
    gpus: list[str] = field(default_factory=lambda: ["h100-80g", "h200-141g"])
    world_size: int | None = None  # --gpus: the recipe's layout at this many GPUs (dp_shard refilled)
    price_per_gpu_hour: float | None = None
    measurement: Measurement | None = None
    context_gib: float = 2.5
    fragmentation: float = 0.05
    budget: run_cost.FailureBudget = field(default_factory=run_cost.FailureBudget)
    epochs: float | None = None  # plan this many epochs instead of train.max_steps
    read_data: bool = True
    max_gpus: int = 2048


def with_world(cfg: JobConfig, gpus: int) -> JobConfig:
    """The recipe's degrees at `gpus` GPUs: its pp, cp and ep, dp_shard refilled."""
    out = layout_config(cfg, gpus, cfg.parallel.pp, cfg.parallel.ep)
    out.parallel.pp_schedule, out.parallel.pp_stages_per_rank = cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank
    out.parallel.pp_microbatches, out.parallel.pp_layer_split = cfg.parallel.pp_microbatches, cfg.parallel.pp_layer_split
    return out


def build_plan(cfg: JobConfig, recipe: str, options: PlanOptions) -> dict[str, Any]:
    if options.world_size is not None:
        cfg = with_world(cfg, options.world_size)
    degrees = degrees_for(cfg)
    spec, model = model_spec(cfg.model), build_meta_model(cfg)
    floor = floor_table(model, _lora_model(cfg, spec)) + [recipe_row(model, spec, resolve_precision(cfg).masters)]

    data: EpochTokens | None = None
    why_no_data = unreadable_data(cfg) if options.read_data else "not read (--no-data)"
    if why_no_data is None:
        model_dir = Path(cfg.model.name_or_path) if (Path(cfg.model.name_or_path) / "config.json").is_file() else None
        data = epoch_tokens(cfg, spec.architecture.vocab_size(spec.architecture.args_of(model)), model_dir)
    one_document = data is None or data.one_document_rows * 2 >= data.rows  # the common row shape
    memory = plan_memory(cfg, model, degrees, one_document)

    layout_note = memory_model_of(cfg).check_layout(spec.architecture.args_of(model), _base_parameters(model, cfg))
    report: dict[str, Any] = {
        "recipe": recipe,
        "model": f"{cfg.model.validate_as or cfg.model.name_or_path}: {model_parameters(model):,} "
                 f"parameters, {'LoRA r=' + str(cfg.peft.rank) if cfg.peft.method == 'lora' else 'full fine-tuning'}",
        **({"adapters": f"LoRA r={cfg.peft.rank} adapters: {adapter_parameters(model):,} parameters (trained; "
                        "not among the model's)"} if cfg.peft.method == "lora" else {}),
        "floor": [vars(row) for row in floor],
        "layout": {"world_size": degrees.world_size, "pp": degrees.pp, "dp_replicate": degrees.dp_replicate,
                   "dp_shard": degrees.dp_shard, "cp": degrees.cp, "ep": degrees.ep, "describe": degrees.describe()},
        "micro_batch": f"{cfg.train.micro_batch_size} x {cfg.data.packed_sequence_size} tokens, activation "
                       f"checkpointing {cfg.parallel.activation_checkpointing}, "
                       f"{'one-document' if one_document else 'packed multi-document'} rows",
        "objective": _objective_note(cfg),
        **({"memory_model": layout_note} if layout_note else {}),
        "memory": memory.to_dict(),
        "headroom": {"context_gib": options.context_gib, "fragmentation": options.fragmentation},
        "data": data.to_dict() if data else {"note": why_no_data},
        "throughput": _throughput_note(options.measurement),
        "gpus": [],
    }
    steps, tokens = _steps_and_tokens(cfg, data, options.epochs)
    for key in options.gpus:
        gpu = gpu_spec(key)
        free = gpu.usable_gib(memory.peak.total / GIB, options.context_gib, options.fragmentation)
        best, _ = smallest_fit(cfg, model, gpu, options.context_gib, options.fragmentation, one_document,
                               options.max_gpus)
        entry: dict[str, Any] = {
            "gpu": key, "memory_gib": gpu.memory_gib,
            "recipe_layout": {"fits": free >= 0, "free_gib": round(free, 2)},
            "smallest_fit": None if best is None else {
                "gpus": best.gpus, "layout": best.layout, "peak_gib": round(best.plan.peak.total / GIB, 2),
                "free_gib": round(best.free_gib, 2)},
        }
        if options.measurement is not None:
            lengths = data.document_lengths if data else [cfg.data.packed_sequence_size]
            flops = spec.architecture.flops_per_token(spec.architecture.args_of(model), lengths)
            entry.update(_run_time(cfg, options, key, flops, (steps, tokens),
                                   memory.state.params + memory.state.optimizer, degrees.world_size))
        report["gpus"].append(entry)
    report["run"] = {"steps": steps, "tokens": tokens,
                     "source": f"{options.epochs:g} epochs of the data" if options.epochs else "train.max_steps"}
    return report


def _base_parameters(model: nn.Module, cfg: JobConfig) -> int:
    """The parameters of the model the checkpoint describes: under LoRA its frozen base, adapters aside."""
    lora = cfg.peft.method == "lora"
    return sum(p.numel() for p in model.parameters() if not (lora and p.requires_grad))


def _lora_model(cfg: JobConfig, spec: ModelSpec) -> nn.Module | None:
    """The recipe's model with LoRA adapters (the recipe's, or the default ones) for the floor's LoRA
    rows; None when the model's family does not take LoRA (its `ModelFamily.limits`)."""
    lora_cfg = copy.deepcopy(cfg)
    lora_cfg.peft.method = "lora"
    if limit_errors(lora_cfg, [limit for limit in spec.family.limits if limit[0] == "peft.method"]):
        return None
    return build_meta_model(lora_cfg)


def _run_time(cfg: JobConfig, options: PlanOptions, gpu: str, flops_per_token: float, run: tuple[int, int],
              ckpt_bytes: int, world_size: int) -> dict[str, Any]:
    """The run's time and cost on `gpu` at the measured speed, and the assumptions behind it."""
    steps, tokens = run
    per_gpu, note = tokens_per_s_per_gpu(options.measurement, flops_per_token, gpu)
    saves = planned_saves(cfg, steps)
    c = run_cost.run_cost(tokens, steps, world_size, per_gpu, ckpt_bytes, saves,
                          cfg.checkpoint.async_save, options.budget, options.price_per_gpu_hour)
    return {"time": c.to_dict(),
            "time_assumption": (f"{note}; {saves} checkpoint saves of {ckpt_bytes / 1e9:.1f} GB per rank at "
                                f"{options.budget.stage_gbps if cfg.checkpoint.async_save else options.budget.write_gbps}"
                                f" GB/s; {c.restarts} restart(s) x {options.budget.restart_minutes:g} min "
                                "+ half a checkpoint interval")}


def _steps_and_tokens(cfg: JobConfig, data: EpochTokens | None, epochs: float | None) -> tuple[int, int]:
    row_tokens = cfg.train.global_batch_size * cfg.data.packed_sequence_size
    if epochs is not None:
        if data is None:
            raise ValueError("--epochs needs the recipe's data (its rows per epoch); the data is not readable here")
        steps = math.ceil(epochs * data.rows / cfg.train.global_batch_size)
    else:
        steps = cfg.train.max_steps
    return steps, steps * row_tokens


def _objective_note(cfg) -> str:
    """What the training objective adds to the step, in the plan's words (docs/preference.md)."""
    if cfg.train.objective == "sft":
        extras = []
        target = ("every token of the documents (data.kind text: continued pretraining)" if cfg.data.kind == "text"
                  else "the assistant turns")
        if cfg.train.mtp_loss_weight > 0:
            mtp = (f"the MTP loss (weight {cfg.train.mtp_loss_weight:g}: one more MoE layer and head pass "
                   "on the last stage, whose parameters and optimizer state count")
            if cfg.parallel.pp > 1:  # docs/plan.md: the terms located on GLM-5's ranks by memory snapshots
                mtp += ("; its second activation at every stage boundary (receive buffers, stage outputs) and "
                        "its layer's fp32 gradient between microbatches count")
            extras.append(mtp + ")")
        if cfg.train.indexer_loss_weight > 0:
            extras.append(f"the indexer KL loss (weight {cfg.train.indexer_loss_weight:g}: the indexers' parameters "
                          "and optimizer state count; the KL's chunked scores are transient)")
        return f"sft: next-token loss on {target}" + "".join(f"; + {x}" for x in extras)
    if cfg.dpo.reference == "none":
        return "dpo, reference-free (SimPO): the step's memory and work are SFT's"
    if cfg.peft.method == "lora":
        return ("dpo: the reference is the model with its adapters off, one extra forward per micro-batch "
                "under no_grad (freed layer by layer): no extra weights, the step's peak is SFT's")
    return ("dpo: the reference's log-probabilities are computed once before training (one forward over "
            "the data) and held per supervised token (4 B each, host memory): no reference weights")


def _throughput_note(measurement: Measurement | None) -> dict[str, Any]:
    if measurement is None:
        return {"note": "pass --throughput RUN_DIR|metrics.jsonl|benchmark.jsonl (a measured GPU run) or "
                        "--tflops-per-gpu X: the plan takes speed from a measurement, not a datasheet"}
    return {"source": f"measured: {measurement.source}, {measurement.tflops_per_gpu:.0f} TFLOP/s per GPU"
                      + (f" ({measurement.mfu:.1%} MFU)" if measurement.mfu else ""),
            "tflops_per_gpu": measurement.tflops_per_gpu, "mfu": measurement.mfu}
