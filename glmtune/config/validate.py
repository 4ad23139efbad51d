"""Cross-field checks of a JobConfig: parallel degrees against the world and the model, batches, schedule.

Mesh rule (FSDP2 + EP, as in torchtitan and NeMo AutoModel):
    world_size = dp_replicate * dp_shard * cp * tp * pp

Expert parallelism adds no ranks: the `ep` ranks that split the routed experts are
carved out of the dp_shard x cp ranks of one replica and pipeline stage, and expert
weights are FSDP-sharded over the remaining `dp_shard * cp / ep` ranks. Hence
`dp_shard * cp % ep == 0` and `num_experts % ep == 0`. NVIDIA's GLM-5 recipe: 256
ranks = dp_shard 64 x pp 4, with ep 64 over those 64 ranks, 4 experts per rank. These
degree rules belong to the mesh (`glmtune.config.degrees.MeshDegrees`); this module
adds the world-size sources, the model's layers, pipeline schedules, batches and ranges.

Runnable rule: a layout can be valid and still need what this version has not built
(tp > 1). `validate_parallel` checks the layout alone; `validate_config`, which
`glmtune config validate` and `glmtune train` run, refuses that degree by name, and what
pipeline or context parallelism cannot do (`pipeline_context_errors`). A model family's limits
on settings (`SettingLimit`s among the `model_refusals`, e.g. the hf family's: no EP, PP or CP, no
GLM-5-only losses) are checked first (`limit_errors`).

Precision rule: `precision_errors` refuses the dtype settings a run cannot honour (fp32
master weights under LoRA) and `fp32_master_weights` decides what
`train.master_weights: auto` means, both without torch, so that
`glmtune config validate` refuses what `glmtune train` refuses and stays fast;
`glmtune.train.precision.resolve_precision` turns the same decision into dtypes.

Pipeline rule: layers need not divide by pp (GLM-5 has 78 layers, NVIDIA runs pp 4).
We only require `pp * pp_stages_per_rank <= num_layers`; the run splits the layers by
their training cost (`glmtune/models/glm5/stage_costs.py`: dense and MoE layers, full
and shared indexers, the LM head on the last stage; GLM-5 over 4 stages -> 20/20/20/18),
or as `parallel.pp_layer_split` says.

All failures are `ValueError`s naming the keys involved, reported together.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from pathlib import PurePosixPath
from typing import Any

from glmtune.config.degrees import MeshDegrees, raise_config_errors as _raise
from glmtune.config.schema import DataConfig, DistillConfig, DpoConfig, JobConfig, ParallelConfig, PeftConfig

# A model family's limit on one setting: (dotted config key, the values it honours, the rest of the
# sentence that refuses another value). The families state them as plain data (models/common/family.py).
SettingLimit = tuple[str, tuple[Any, ...], str]

# Schedules that place one stage per rank, and the V-shaped ones that need exactly two.
_SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
_TWO_STAGE_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
_ROUND_BASED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def resolve_world_size(parallel: ParallelConfig, world_size: int | None = None) -> int:
    """The launcher's world size, else `parallel.world_size`, else nodes x gpus_per_node.

    Sources that are given must agree. With none of them: the product of the degrees
    when dp_shard is explicit, otherwise 1 (a single process).
    """
    claims: list[tuple[str, int]] = []
    if world_size is not None:
        claims.append(("the launcher's world size", world_size))
    if parallel.world_size is not None:
        claims.append(("parallel.world_size", parallel.world_size))
    if parallel.nodes is not None and parallel.gpus_per_node is not None:
        claims.append(("parallel.nodes x parallel.gpus_per_node", parallel.nodes * parallel.gpus_per_node))
    if claims:
        first_name, first = claims[0]
        for name, value in claims[1:]:
            if value != first:
                raise ValueError(f"{first_name} ({first}) disagrees with {name} ({value})")
        if first < 1:
            raise ValueError(f"{first_name} must be >= 1, got {first}")
        return first
    if parallel.dp_shard != -1:
        p = parallel
        return p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    return 1


def validate_parallel(cfg: JobConfig, num_experts: int, num_layers: int, world_size: int | None = None) -> MeshDegrees:
    """Check the layout against the world size and the model; return the resolved degrees.

    This checks the layout as the schema defines it, pipeline schedules included;
    `validate_config` also refuses the degrees this version cannot run yet.
    """
    p = cfg.parallel
    errors = []
    if p.pp_stages_per_rank < 1:
        errors.append(f"parallel.pp_stages_per_rank must be >= 1, got {p.pp_stages_per_rank}")
    if (p.nodes is None) != (p.gpus_per_node is None):
        errors.append("parallel.nodes and parallel.gpus_per_node must be set together")
    if p.launcher == "slurm" and p.nodes is None:
        errors.append("parallel.launcher slurm needs parallel.nodes and parallel.gpus_per_node")
    _raise(errors)

    degrees = MeshDegrees.resolve(p, resolve_world_size(p, world_size))
    errors = degrees.layout_errors(num_experts)
    num_stages = p.pp * p.pp_stages_per_rank
    if num_stages > num_layers:
        errors.append(
            f"parallel.pp x parallel.pp_stages_per_rank ({p.pp} x {p.pp_stages_per_rank} = {num_stages}) "
            f"exceeds the model's {num_layers} layers"
        )
    errors += _schedule_errors(cfg)
    chunks = 2 * p.cp if p.cp_balance == "head_tail" else p.cp
    if p.cp > 1 and cfg.data.packed_sequence_size % chunks:
        how = (f"2 x parallel.cp ({chunks}): parallel.cp_balance head_tail cuts each packed row into 2 x cp chunks "
               "and gives each rank a first and a last one" if p.cp_balance == "head_tail" else
               f"parallel.cp ({p.cp}): parallel.cp_balance contiguous cuts each packed row into cp chunks")
        errors.append(f"data.packed_sequence_size ({cfg.data.packed_sequence_size}) must be divisible by {how}")
    _raise(errors)
    return degrees


def pipeline_microbatches(cfg: JobConfig) -> int:
    """Pipeline microbatches per micro batch (null = one row each)."""
    return cfg.parallel.pp_microbatches or cfg.train.micro_batch_size


def _schedule_errors(cfg: JobConfig) -> list[str]:
    p = cfg.parallel
    schedule, per_rank = p.pp_schedule, p.pp_stages_per_rank
    errors = []
    if p.pp == 1:
        if per_rank != 1:
            errors.append(f"parallel.pp_stages_per_rank ({per_rank}) must be 1 when parallel.pp is 1")
        return errors
    if schedule in _SINGLE_STAGE_SCHEDULES and per_rank != 1:
        errors.append(f"parallel.pp_schedule {schedule} runs one stage per rank; set parallel.pp_stages_per_rank: 1")
    if schedule in _TWO_STAGE_SCHEDULES and per_rank != 2:
        errors.append(f"parallel.pp_schedule {schedule} needs parallel.pp_stages_per_rank: 2, got {per_rank}")
    micro = pipeline_microbatches(cfg)
    if micro < 1 or cfg.train.micro_batch_size % micro:
        errors.append(
            f"parallel.pp_microbatches ({micro}) must divide train.micro_batch_size ({cfg.train.micro_batch_size})"
        )
        return errors
    # torch.distributed.pipelining raises these at schedule construction; catch them before a 256-GPU launch.
    num_stages = p.pp * per_rank
    if schedule in ("1F1B", "DualPipeV") and micro < num_stages:
        errors.append(
            f"parallel.pp_schedule {schedule} needs at least as many microbatches as stages: "
            f"parallel.pp_microbatches (or train.micro_batch_size) is {micro}, stages {num_stages}"
        )
    if schedule in _ROUND_BASED_SCHEDULES:
        rounds = max(1, micro // p.pp)
        if micro % rounds:
            errors.append(
                f"parallel.pp_schedule {schedule} needs parallel.pp_microbatches ({micro}) to be a multiple of "
                f"{rounds} (microbatches // parallel.pp)"
            )
    return errors


def grad_accum_steps(cfg: JobConfig, degrees: MeshDegrees) -> int:
    """Micro batches each rank accumulates per optimizer step."""
    t = cfg.train
    per_step = t.micro_batch_size * degrees.dp
    if t.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size x "
            f"data-parallel degree (parallel.dp_replicate x dp_shard = {degrees.dp}): {t.micro_batch_size} x "
            f"{degrees.dp} = {per_step}"
        )
    return t.global_batch_size // per_step


def validate_config(cfg: JobConfig, num_experts: int, num_layers: int, world_size: int | None = None,
                    model_refusals: tuple[str | SettingLimit, ...] = ()) -> MeshDegrees:
    """All checks a run needs before anything is allocated: the parallel layout, the degrees
    this version can run (pp, cp, tp > 1 cannot yet), batch divisibility, per-field ranges
    and the precision settings. `model_refusals`: what the model's family refuses (the
    registry's `ModelDims.refusals`; config/ knows no model): sentences about the recipe's `model`
    section, and the family's limits on settings (`limit_errors`). Those come first, alone: the
    layout checks of a degree the family cannot run at all would only mislead.

    `glmtune config validate` and the start of `glmtune train` call this same function.
    """
    _raise(limit_errors(cfg, [limit for limit in model_refusals if not isinstance(limit, str)]))
    degrees = validate_parallel(cfg, num_experts, num_layers, world_size)
    errors = degrees.not_built_errors() + check_ranges(cfg) + precision_errors(cfg) + fp8_base_errors(cfg) \
        + absorbed_attention_errors(cfg) + norm_backend_errors(cfg) \
        + [refusal for refusal in model_refusals if isinstance(refusal, str)] \
        + pipeline_context_errors(cfg, num_layers) + objective_errors(cfg) + auxiliary_loss_errors(cfg) \
        + text_data_errors(cfg) + chat_template_errors(cfg) + replay_errors(cfg)
    try:
        grad_accum_steps(cfg, degrees)
    except ValueError as exc:
        errors.append(str(exc))
    _raise(errors)
    return degrees


def limit_errors(cfg: JobConfig, limits: list[SettingLimit]) -> list[str]:
    """One sentence per setting of `cfg` outside a model family's limit: (dotted key, the values the
    family honours, the rest of the sentence after "<key>: <value> ")."""
    errors = []
    for key, honoured, why in limits:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value not in honoured:
            errors.append(f"{key}: {value} {why}")
    return errors


def pipeline_context_errors(cfg: JobConfig, num_layers: int) -> list[str]:
    """Pipeline and context-parallel settings that would not take effect or cannot run."""
    p, errors = cfg.parallel, []
    split = p.pp_layer_split
    if p.pp == 1:
        defaults = ParallelConfig()
        for key in ("pp_schedule", "pp_microbatches", "pp_layer_split", "pp_ep_overlap"):
            if getattr(p, key) != getattr(defaults, key):
                errors.append(f"parallel.{key} is set but parallel.pp is 1 (no pipeline); remove it or set parallel.pp")
    elif split:
        stages = p.pp * p.pp_stages_per_rank
        if len(split) != stages:
            errors.append(f"parallel.pp_layer_split has {len(split)} entries, but the pipeline has parallel.pp x "
                          f"parallel.pp_stages_per_rank = {p.pp} x {p.pp_stages_per_rank} = {stages} stages")
        elif min(split) < 1 or sum(split) != num_layers:
            errors.append(f"parallel.pp_layer_split {split} must give every stage at least one layer and sum to "
                          f"the model's {num_layers} layers (it sums to {sum(split)})")
    if p.cp == 1 and p.cp_balance != ParallelConfig().cp_balance:
        errors.append("parallel.cp_balance is set but parallel.cp is 1 (no context parallelism); remove it or set "
                      "parallel.cp")
    degrees = [f"parallel.{key}: {getattr(p, key)}" for key in ("pp", "cp") if getattr(p, key) > 1]
    if degrees and cfg.train.generate_samples:
        errors.append(f"train.generate_samples ({cfg.train.generate_samples}) answers prompts greedily with the whole "
                      f"model in each process, which {' and '.join(degrees)} split; set train.generate_samples: 0 "
                      "(score the run with the exported model instead)")
    return errors


def objective_errors(cfg: JobConfig) -> list[str]:
    """`train.objective` and the `dpo` section: settings that would be ignored, or that the
    preference objective cannot honour (why: docs/preference.md)."""
    t, dpo, d = cfg.train, cfg.dpo, cfg.data
    errors = distill_errors(cfg)
    if t.objective == "distill":
        return errors + [f"dpo.{f.name} is set but train.objective is distill; remove it" for f in
                         dataclasses.fields(DpoConfig) if getattr(dpo, f.name) != getattr(DpoConfig(), f.name)]
    if t.objective == "sft":
        defaults = DpoConfig()
        errors += [f"dpo.{f.name} is set but train.objective is sft; set train.objective: dpo or remove it"
                   for f in dataclasses.fields(DpoConfig) if getattr(dpo, f.name) != getattr(defaults, f.name)]
        if d.synthetic is not None and d.synthetic.kind == "support_preferences":
            errors.append("data.synthetic.kind: support_preferences makes preference rows; train.objective: sft "
                          "needs chat rows (kind support_tickets), or set train.objective: dpo")
        return errors
    rules = [
        (dpo.beta > 0, f"dpo.beta must be > 0, got {dpo.beta}"),
        (0 <= dpo.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}"),
        (dpo.sft_weight >= 0, f"dpo.sft_weight must be >= 0, got {dpo.sft_weight}"),
        (dpo.simpo_gamma >= 0, f"dpo.simpo_gamma must be >= 0, got {dpo.simpo_gamma}"),
        (dpo.loss != "ipo" or dpo.label_smoothing == 0,
         "dpo.label_smoothing with dpo.loss: ipo: IPO's squared loss has no label smoothing; use loss sigmoid "
         "(cDPO) or robust"),
        (dpo.reference == "model" or dpo.loss == "sigmoid",
         f"dpo.reference: none is SimPO, a sigmoid loss on length-normalized log-probabilities; dpo.loss: "
         f"{dpo.loss} needs a reference model"),
        (dpo.reference == "none" or dpo.simpo_gamma == DpoConfig().simpo_gamma,
         "dpo.simpo_gamma is set but dpo.reference is model (the margin is SimPO's, reference: none)"),
        (d.loss_on == DataConfig().loss_on,
         f"data.loss_on: {d.loss_on} with train.objective: dpo: the preference loss reads the chosen and "
         "rejected answers only; remove data.loss_on"),
        (d.synthetic is None or d.synthetic.kind == "support_preferences",
         f"data.synthetic.kind: {d.synthetic.kind if d.synthetic else None} makes chat rows; "
         "train.objective: dpo needs preference rows (kind support_preferences)"),
        (d.too_long == "drop",
         "data.too_long: truncate with train.objective: dpo: a cut answer is not the answer that was preferred; "
         "pairs longer than data.packed_sequence_size are dropped (set data.too_long: drop)"),
        (t.generate_samples == 0,
         "train.generate_samples answers held-out prompts for SFT runs; with train.objective: dpo set it to 0 "
         "and score the run with glmtune eval's preference scorer"),
    ]
    return errors + [message for ok, message in rules if not ok]


def distill_errors(cfg: JobConfig) -> list[str]:
    """`train.objective: distill` and the `distill` section (docs/distill.md): each key takes effect or is
    refused here; the teacher directory itself (manifest, tokenizer, sidecar) when the data is read."""
    t, x, d = cfg.train, cfg.distill, cfg.data
    if t.objective != "distill":
        return [f"distill.{f.name} is set but train.objective is {t.objective}; set train.objective: distill or "
                "remove it" for f in dataclasses.fields(DistillConfig)
                if getattr(x, f.name) != getattr(DistillConfig(), f.name)]
    rules = [
        (math.isfinite(x.weight) and x.weight >= 0, f"distill.weight must be >= 0, got {x.weight}"),
        (math.isfinite(x.temperature) and x.temperature > 0, f"distill.temperature must be > 0, got {x.temperature}"),
        (x.weight > 0 or x.temperature == DistillConfig().temperature,
         "distill.temperature is set but distill.weight is 0 (sequence-level only: no KL to soften); remove it"),
        (len(d.train) == 1 and d.synthetic is None,
         "train.objective: distill reads one teacher directory: data.train must name its rows file alone "
         "(no data.synthetic)"),
        (d.too_long == "drop", "data.too_long: truncate with train.objective: distill: a cut answer is not the "
                               "teacher's; set data.too_long: drop"),
        (d.kind == "chat", f"data.kind: {d.kind} with train.objective: distill: the teacher's answers are chat rows; "
                           "remove data.kind"),
    ]
    return [message for ok, message in rules if not ok]


_TEXT_KEYS = ("text_field", "text_separator", "source_field", "min_document_tokens", "max_document_tokens",
              "long_documents", "long_document_overlap")
_CHAT_KEYS = ("loss_on", "enable_thinking", "json_schema", "chat_template", "too_long", "synthetic")


def text_data_errors(cfg: JobConfig) -> list[str]:
    """`data.kind: text` (raw documents, docs/data.md) and its keys: each takes effect or is refused,
    and the chat-only keys are refused with it (a text document has no template, turns or answers)."""
    d, defaults = cfg.data, DataConfig()
    changed = [key for key in (_TEXT_KEYS if d.kind == "chat" else _CHAT_KEYS)
               if getattr(d, key) != getattr(defaults, key)]
    if d.kind == "chat":
        return [f"data.{key} is set but data.kind is chat; set data.kind: text or remove it" for key in changed]
    errors = [f"data.{key} is for chat rows and data.kind is text; remove it"
              + (" (a document longer than a row: see data.long_documents)" if key == "too_long" else "")
              for key in changed]
    size, overlap = d.packed_sequence_size, d.long_document_overlap
    rules = [
        (d.format != "hf_datasets", "data.format: hf_datasets with data.kind: text; text documents are read from "
                                    ".txt/.md, .jsonl or .parquet files"),
        (bool(d.text_field), "data.text_field is empty"),
        (d.text_separator is None or d.text_separator != "", "data.text_separator is empty; null = one document "
                                                              "per file"),
        (d.source_field is None or (d.source_field and d.source_field != d.text_field),
         f"data.source_field must name another key than data.text_field ({d.text_field!r}), or be null"),
        (d.min_document_tokens >= 1, f"data.min_document_tokens must be >= 1, got {d.min_document_tokens}"),
        (d.max_document_tokens is None or d.max_document_tokens >= d.min_document_tokens,
         f"data.max_document_tokens ({d.max_document_tokens}) must be >= data.min_document_tokens "
         f"({d.min_document_tokens}) or null"),
        (0 <= overlap <= size // 2, f"data.long_document_overlap must be between 0 and half of "
                                    f"data.packed_sequence_size ({size // 2}), got {overlap}"),
        (overlap == 0 or d.long_documents == "split",
         f"data.long_document_overlap is set but data.long_documents is {d.long_documents}; it applies to split"),
        (cfg.train.objective == "sft", "train.objective: dpo needs preference rows; data.kind: text trains the "
                                       "next-token loss (train.objective: sft)"),
        (cfg.train.generate_samples == 0, "train.generate_samples answers held-out chat prompts; with data.kind: "
                                          "text set it to 0"),
    ]
    return errors + [message for ok, message in rules if not ok]


def replay_errors(cfg: JobConfig) -> list[str]:
    """`data.replay` (the replay mix, docs/data.md): one weight in (0, 1), so the two shares cannot fail to sum
    to one; something to replay; chat rows from the generator; the next-token objective. The mix has no
    tokenizer key of its own (an unknown key to the loader): both sources are tokenized by the run's."""
    r = cfg.data.replay
    if r is None:
        return []
    rules = [
        (math.isfinite(r.weight) and 0 < r.weight < 1,
         f"data.replay.weight must be in (0, 1), the replay's share of the target tokens (the run's own data "
         f"gets the rest), got {r.weight}"),
        (bool(r.train) or r.synthetic is not None,
         "data.replay.train is empty and data.replay.synthetic is not set: nothing to replay"),
        (r.synthetic is None or r.kind == "chat",
         "data.replay.synthetic generates chat rows but data.replay.kind is text; set data.replay.kind: chat"),
        (r.synthetic is None or r.synthetic.kind == "support_tickets",
         "data.replay.synthetic.kind: support_preferences makes preference rows; a replay mixes chat rows "
         "(kind support_tickets) or text"),
        (cfg.train.objective == "sft",
         f"data.replay with train.objective: {cfg.train.objective}: a replay mix trains the next-token loss "
         "(train.objective: sft)"),
    ]
    return [message for ok, message in rules if not ok]


def chat_template_errors(cfg: JobConfig) -> list[str]:
    """`data.chat_template`: no command reads a template apart from the tokenizer yet (the template is
    the tokenizer directory's own, else GLM-5's), so a path there is refused, never ignored."""
    if cfg.data.kind != "chat" or cfg.data.chat_template is None:
        return []  # data.kind: text refuses the key itself (text_data_errors)
    return [f"data.chat_template {cfg.data.chat_template}: a template file apart from the tokenizer is not read; "
            "save it as chat_template.jinja in the tokenizer directory (data.tokenizer) and remove data.chat_template"]


def auxiliary_loss_errors(cfg: JobConfig) -> list[str]:
    """The MTP and indexer losses (`train.mtp_loss_weight`, `train.indexer_loss_weight`,
    `model.indexer_trainable`, `train.indexer_warmup_steps`): each takes effect or is refused."""
    t, m = cfg.train, cfg.model
    indexer_on = t.indexer_loss_weight > 0
    rules = [
        (t.mtp_loss_weight >= 0, f"train.mtp_loss_weight must be >= 0, got {t.mtp_loss_weight}"),
        (t.indexer_loss_weight >= 0, f"train.indexer_loss_weight must be >= 0, got {t.indexer_loss_weight}"),
        (t.indexer_warmup_steps >= 0, f"train.indexer_warmup_steps must be >= 0, got {t.indexer_warmup_steps}"),
        (indexer_on == m.indexer_trainable,
         "model.indexer_trainable: true needs train.indexer_loss_weight > 0 (the indexer learns from its KL loss "
         "only)" if m.indexer_trainable else
         "train.indexer_loss_weight > 0 needs model.indexer_trainable: true (a frozen indexer has nothing to learn)"),
        (t.indexer_warmup_steps == 0 or indexer_on,
         "train.indexer_warmup_steps trains the indexers alone: it needs train.indexer_loss_weight > 0 and "
         "model.indexer_trainable: true"),
        (t.indexer_warmup_steps < t.max_steps,
         f"train.indexer_warmup_steps ({t.indexer_warmup_steps}) must be < train.max_steps ({t.max_steps}): the "
         "model itself would never train"),
        (t.indexer_warmup_steps == 0 or cfg.parallel.pp == 1,
         f"train.indexer_warmup_steps ({t.indexer_warmup_steps}) with parallel.pp > 1: the stage outputs carry no "
         "graph during the warm-up (the main model runs without gradients); set train.indexer_warmup_steps: 0 or "
         "warm up without pipeline parallelism"),
    ]
    extras = [name for name, on in (("train.mtp_loss_weight", t.mtp_loss_weight > 0),
                                    ("model.indexer_trainable", m.indexer_trainable)) if on]
    for name in extras:
        rules.append((t.objective == "sft", f"{name} with train.objective: {t.objective}: the auxiliary losses ride "
                                            "on the next-token loss (SFT); remove it for preference optimization"))
    # Under LoRA the MTP layer takes adapters like the decoder layers (glmtune/peft/apply.py); the
    # indexers learn from their KL loss as full weights, which no adapter carries.
    rules.append((cfg.peft.method == "none" or not m.indexer_trainable,
                  f"model.indexer_trainable with peft.method: {cfg.peft.method}: the indexers train as full weights, "
                  "which a PEFT adapter cannot carry; use full fine-tuning (peft.method: none)"))
    return [message for ok, message in rules if not ok]


def precision_errors(cfg: JobConfig) -> list[str]:
    """The dtype settings a run cannot honour, each naming its keys (why: `glmtune/train/precision.py`)."""
    errors = []
    if cfg.train.master_weights == "fp32" and cfg.peft.method != "none":
        errors.append("train.master_weights: fp32 with peft.method: lora: the LoRA adapters are fp32 already and "
                      "the base is frozen (fp32 copies of it would only double its memory); use auto or none")
    if cfg.optim.fused is True and fp32_master_weights(cfg) and cfg.model.dtype == "bfloat16":
        errors.append("optim.fused: true with fp32 master weights (train.master_weights: "
                      f"{cfg.train.master_weights}): torch's fused AdamW holds no masters of bf16 parameters; use "
                      "optim.fused: auto or triton (glmtune's fused master kernel), or train.master_weights: none")
    return errors


def fp8_base_errors(cfg: JobConfig) -> list[str]:
    """What a frozen FP8 base (`model.fp8_base`) cannot run with in this version."""
    if cfg.model.fp8_base == "none":
        return []
    key, errors = f"model.fp8_base: {cfg.model.fp8_base}", []
    if cfg.peft.method != "lora":
        errors.append(f"{key} needs peft.method: lora (an FP8 base is frozen: only adapters train on it)")
    if cfg.model.fp8_base == "triton" and cfg.train.device == "cpu":
        errors.append(f"{key} runs Triton kernels on a CUDA GPU, not train.device: cpu; use dequant there")
    # On a preset it is refused by the model registry (`ModelDims.refusals`): config/ knows no preset.
    return errors


def absorbed_attention_errors(cfg: JobConfig) -> list[str]:
    """The absorbed backends multiply by kv_b_proj's weight (W_uk into the queries, W_uv on the
    output latent) instead of calling the layer: they need that weight plain. "absorbed_triton"
    runs Triton kernels on a CUDA GPU in bf16 (fp32 dots there would be TF32's)."""
    backend = cfg.model.attention_backend
    if backend not in ("absorbed", "absorbed_triton"):
        return []
    key, errors = f"model.attention_backend: {backend}", []
    if cfg.model.fp8_base != "none":
        errors.append(f"{key} reads kv_b_proj's weight directly and cannot take model.fp8_base: "
                      f"{cfg.model.fp8_base}; use another attention backend")
    name = "model.layers.0.self_attn.kv_b_proj"  # the module every layer's adapter globs are matched on
    targets = cfg.peft.target_modules or []
    if cfg.peft.method == "lora" and any(fnmatch.fnmatchcase(name, glob) for glob in targets) \
            and not any(fnmatch.fnmatchcase(name, glob) for glob in cfg.peft.exclude_modules):
        errors.append(f"{key} reads kv_b_proj's base weight directly and would skip a kv_b_proj adapter: drop "
                      "kv_b_proj from peft.target_modules (or add it to peft.exclude_modules)")
    if backend == "absorbed_triton" and cfg.train.device == "cpu":
        errors.append(f"{key} runs Triton kernels on a CUDA GPU, not train.device: cpu; use absorbed there")
    if backend == "absorbed_triton" and cfg.model.dtype != "bfloat16":
        errors.append(f"{key} computes in bf16, not model.dtype: {cfg.model.dtype}; use absorbed for fp32")
    return errors


def norm_backend_errors(cfg: JobConfig) -> list[str]:
    """The Triton RMSNorm runs on a CUDA GPU (`device_errors` refuses it where `auto` finds none)."""
    if cfg.model.norm_backend == "triton" and cfg.train.device == "cpu":
        return ["model.norm_backend: triton runs Triton kernels on a CUDA GPU, not train.device: cpu; use torch there"]
    return []


def device_errors(cfg: JobConfig, device_type: str) -> list[str]:
    """What the device `train.device` resolved to cannot run ("auto" finds a GPU or not only when the
    job starts; `absorbed_attention_errors`, `norm_backend_errors` and `fp8_base_errors` refuse an explicit
    cpu). Called
    before the model is built."""
    errors = []
    if cfg.model.attention_backend == "absorbed_triton" and device_type != "cuda":
        errors.append(f"model.attention_backend: absorbed_triton runs Triton kernels on a CUDA GPU, and "
                      f"train.device: {cfg.train.device} found none here (it runs on {device_type}); use absorbed, "
                      "its pure-torch form")
    if cfg.model.norm_backend == "triton" and device_type != "cuda":
        errors.append(f"model.norm_backend: triton runs Triton kernels on a CUDA GPU, and train.device: "
                      f"{cfg.train.device} found none here (it runs on {device_type}); use torch")
    if cfg.model.fp8_base == "triton" and device_type != "cuda":
        errors.append(f"model.fp8_base: triton runs Triton kernels on a CUDA GPU, and train.device: "
                      f"{cfg.train.device} found none here (it runs on {device_type}); use dequant")
    return errors


def fp32_master_weights(cfg: JobConfig) -> bool:
    """Whether AdamW updates fp32 weights (with model.dtype bfloat16: fp32 masters the optimizer
    holds for the bf16 parameters): `train.master_weights: fp32`, or `auto` for full fine-tuning
    with model.dtype bfloat16 (LoRA's adapters are fp32 already and its base is frozen)."""
    choice = cfg.train.master_weights
    return choice == "fp32" or (choice == "auto" and cfg.model.dtype == "bfloat16" and cfg.peft.method == "none")


def planned_saves(cfg: JobConfig, steps: int) -> int:
    """Checkpoints a run of `steps` steps writes as planned (`checkpoint.every_steps`, and the one at
    the end unless `checkpoint.save_at_end` is false or a periodic save falls on the last step);
    a stop request saves one more."""
    every = cfg.checkpoint.every_steps
    periodic = steps // every if every else 0
    return periodic + (1 if cfg.checkpoint.save_at_end and (not every or steps % every) else 0)


def check_ranges(cfg: JobConfig) -> list[str]:
    """Single-section value checks that types alone cannot express."""
    rules = _train_rules(cfg) + _optim_rules(cfg) + _checkpoint_data_rules(cfg) + _model_parallel_logging_rules(cfg)
    errors = non_finite_errors(cfg)  # the loader refuses these; a config built in code reaches here too
    errors += [message for ok, message in rules if not ok]
    errors += _split_errors(cfg.data.split)
    errors += _lora_errors(cfg) if cfg.peft.method == "lora" else _peft_without_lora_errors(cfg.peft)
    return errors


def _train_rules(cfg: JobConfig) -> list[tuple[bool, str]]:
    """(holds, message) for the train section's ranges."""
    t = cfg.train
    return [
        (t.max_steps >= 1, f"train.max_steps must be >= 1, got {t.max_steps}"),
        (t.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {t.global_batch_size}"),
        (t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}"),
        (t.val_every >= 0, f"train.val_every must be >= 0 (0 = never), got {t.val_every}"),
        (t.val_steps is None or t.val_steps >= 1, f"train.val_steps must be >= 1 or null, got {t.val_steps}"),
        (t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}"),
        (t.clip_grad_norm is None or t.clip_grad_norm > 0,
         f"train.clip_grad_norm must be > 0 or null, got {t.clip_grad_norm}"),
        (t.router_bias_update_rate >= 0,
         f"train.router_bias_update_rate must be >= 0, got {t.router_bias_update_rate}"),
        (t.generate_samples >= 0, f"train.generate_samples must be >= 0, got {t.generate_samples}"),
    ]


def _optim_rules(cfg: JobConfig) -> list[tuple[bool, str]]:
    """(holds, message) for the optim section's ranges (the warm-up against train.max_steps)."""
    o, max_steps = cfg.optim, cfg.train.max_steps
    return [
        (o.lr > 0, f"optim.lr must be > 0, got {o.lr}"),
        (o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}"),
        (all(0 <= b < 1 for b in o.betas), f"optim.betas must be in [0, 1), got {list(o.betas)}"),
        (o.eps > 0, f"optim.eps must be > 0, got {o.eps}"),
        (o.lr * o.weight_decay < 1, f"optim.lr x optim.weight_decay ({o.lr:g} x {o.weight_decay:g}) must be < 1: "
                                    "AdamW scales every weight by 1 - lr x weight_decay each step"),
        (0 <= o.warmup_steps <= max_steps,
         f"optim.warmup_steps ({o.warmup_steps}) must be between 0 and train.max_steps ({max_steps})"),
        (o.warmup_ratio is None or 0 <= o.warmup_ratio <= 1,
         f"optim.warmup_ratio must be in [0, 1] (a fraction of train.max_steps) or null, got {o.warmup_ratio}"),
        (0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}"),
    ]


def _checkpoint_data_rules(cfg: JobConfig) -> list[tuple[bool, str]]:
    """(holds, message) for the checkpoint and data sections' ranges."""
    c, d = cfg.checkpoint, cfg.data
    return [
        (c.every_steps >= 0, f"checkpoint.every_steps must be >= 0 (0 = only at the end), got {c.every_steps}"),
        (c.keep_last >= 0, f"checkpoint.keep_last must be >= 0 (0 = keep all), got {c.keep_last}"),
        (c.resume != "", "checkpoint.resume must be none, auto or a checkpoint path"),
        (bool(d.train) or d.synthetic is not None,
         "data.train is empty and data.synthetic is not set: no training data"),
        (d.synthetic is None or d.synthetic.rows >= 1,
         f"data.synthetic.rows must be >= 1, got {d.synthetic.rows if d.synthetic else None}"),
        (d.packed_sequence_size >= 1, f"data.packed_sequence_size must be >= 1, got {d.packed_sequence_size}"),
    ]


def _model_parallel_logging_rules(cfg: JobConfig) -> list[tuple[bool, str]]:
    """(holds, message) for the model, parallel (expert dispatch) and logging sections' ranges."""
    p = cfg.parallel
    return [
        (bool(cfg.model.name_or_path), "model.name_or_path is empty"),
        (p.ep != 1 or p.ep_dispatcher == "all_to_all",
         f"parallel.ep_dispatcher: {p.ep_dispatcher} moves tokens between expert-parallel ranks and "
         "has no effect with parallel.ep: 1; remove it or set parallel.ep"),
        (p.ep_overlap_chunks == 1 or (p.ep_overlap_chunks > 1 and p.ep != 1 and p.ep_dispatcher == "all_to_all"),
         f"parallel.ep_overlap_chunks: {p.ep_overlap_chunks} must be 1, or more with parallel.ep > 1 and "
         "parallel.ep_dispatcher: all_to_all (the chunks overlap the expert all-to-alls)"),
        (p.ep_keep_exchanges == "none" or (p.ep != 1 and p.ep_dispatcher == "all_to_all"
                                           and p.activation_checkpointing == "full" and not p.compile),
         f"parallel.ep_keep_exchanges: {p.ep_keep_exchanges} keeps what the expert all-to-alls received for full "
         "activation checkpointing's recomputation: it needs parallel.ep > 1, ep_dispatcher: all_to_all, "
         "activation_checkpointing: full and compile: false"),
        (not p.pp_ep_overlap or p.pp == 1 or (p.pp_schedule == "DualPipeV" and p.ep != 1
                                                 and p.ep_dispatcher == "all_to_all" and not p.compile),
         "parallel.pp_ep_overlap pairs DualPipeV's forwards and backwards at the expert all-to-alls: it needs "
         f"parallel.pp_schedule: DualPipeV (got {p.pp_schedule}), parallel.ep > 1, ep_dispatcher: all_to_all "
         "and compile: false"),
        (cfg.model.attention_score_buffer_mib >= 0,
         f"model.attention_score_buffer_mib must be >= 0 (0 = never), got {cfg.model.attention_score_buffer_mib}"),
        (bool(cfg.logging.metrics_file), "logging.metrics_file is empty"),
        (not cfg.logging.metrics_file or _relative_inside(cfg.logging.metrics_file),
         f"logging.metrics_file {cfg.logging.metrics_file!r} must be a path inside the run directory (relative, "
         "without '..'): a resume rewrites that file"),
    ]


def _lora_errors(cfg: JobConfig) -> list[str]:
    """LoRA's ranges, and the train settings no adapter can carry."""
    peft, t = cfg.peft, cfg.train
    return [message for ok, message in (
        (peft.rank >= 1, f"peft.rank must be >= 1, got {peft.rank}"),
        (peft.alpha > 0, f"peft.alpha must be > 0, got {peft.alpha}"),
        (0 <= peft.dropout < 1, f"peft.dropout must be in [0, 1), got {peft.dropout}"),
        (peft.target_modules != [], "peft.target_modules is empty: LoRA would train nothing"),
        # The correction biases are base buffers an adapter cannot carry: PEFT, vLLM and SGLang
        # would serve the old routing, not the model that was trained.
        (t.router_bias_update == "none",
         f"train.router_bias_update: {t.router_bias_update} with peft.method: lora would change the "
         "routers' correction biases, which no LoRA adapter carries (PEFT, vLLM and SGLang would route "
         "with the base's biases, not the trained ones); set train.router_bias_update: none"),
    ) if not ok]


def _peft_without_lora_errors(peft: PeftConfig) -> list[str]:
    """One error per LoRA setting changed while peft.method is none: it would be validated and then ignored."""
    defaults = PeftConfig()
    return [f"peft.{f.name} is set but peft.method is none; set peft.method: lora or remove it"
            for f in dataclasses.fields(PeftConfig)
            if f.name != "method" and getattr(peft, f.name) != getattr(defaults, f.name)]


def non_finite_errors(value: object, path: str = "") -> list[str]:
    """One error per NaN or infinite float in a config tree (fields, list items, mapping values)."""
    if dataclasses.is_dataclass(value):
        items = [(f"{path}.{f.name}" if path else f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = [(f"{path}.{key}", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    elif isinstance(value, float) and not math.isfinite(value):
        return [f"{path} must be a finite number, got {value}"]
    else:
        return []
    return [error for sub, item in items for error in non_finite_errors(item, sub)]


def _relative_inside(path: str) -> bool:
    """`path` names a file below the directory it is joined to (relative, no `..`, no NUL)."""
    pure = PurePosixPath(path)
    return not pure.is_absolute() and ".." not in pure.parts and "\0" not in path and pure.name not in ("", ".")


def _split_errors(split: dict[str, float]) -> list[str]:
    unknown = sorted(set(split) - {"train", "validation", "test"})
    if unknown:
        return [f"data.split: unknown split name(s) {', '.join(unknown)}; use train, validation, test"]
    if "train" not in split:
        return ["data.split must have a train ratio"]
    if any(not 0 < r <= 1 for r in split.values()):
        return [f"data.split ratios must be in (0, 1], got {split}"]
    if not math.isclose(sum(split.values()), 1.0, abs_tol=1e-6):
        return [f"data.split ratios must sum to 1, got {sum(split.values())}"]
    return []
