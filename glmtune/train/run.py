"""`glmtune train`: one run from a resolved config to checkpoints and an HF export.

`run_training` is a sequence of named steps, each taking config sections and the small
typed objects the steps before it made:

  1. check_launch          the recipe against the world size and the model; device, precision
  2. claim_run_directory   lock, no mixed runs, writable (nothing is written before this);
                           the resolved config saved; seeds set
  3. build_model           on the meta device under torchrun for an HF checkpoint (each rank
                           reads only its shards after step 5); a preset's base written; LoRA
  4. prepare_run_data      contract check before anything trains, split, tokenize, pack
  5. lay_out_and_load      the mesh, parallelize (PP -> EP -> CP -> AC -> compile -> FSDP2) into
                           the model family's step runner, the sharded load; "before" samples
  6. build_trainer         optimizer, schedule, loaders, checkpoints, disk space, metrics; resume
  7. train                 the trainer's loop
  8. finish                "after" samples, the LoRA adapters or the HF export

What a run holds open (the run directory's lock, a one-rank process group) is released by
one ExitStack when it ends, however it ends. Rank 0 alone writes files other than DCP shards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from rich.console import Console
from rich.table import Table
from rich.text import Text

from glmtune.checkpoint.manager import CheckpointManager
from glmtune.checkpoint.space import check_free_space, checkpoint_bytes, export_bytes
from glmtune.config import JobConfig, config_to_dict, config_to_yaml, grad_accum_steps, pipeline_microbatches
from glmtune.config.degrees import MeshDegrees
from glmtune.config.validate import planned_saves
from glmtune.data.chat_template import load_chat_template, template_format_of
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.distributed.agreement import decide_on_rank0
from glmtune.distributed.mesh import ParallelMesh
from glmtune.distributed.pipeline_plan import describe_split
from glmtune.io.interrupts import raise_if_interrupted
from glmtune.io.run_lock import STOP_FILE, read_run_record, write_run_record
from glmtune.io.sizes import human_bytes
from glmtune.io.text_limits import printable
from glmtune.kernels.device_peaks import peak_tflops
from glmtune.kernels.fp8_blocks import is_fp8
from glmtune.kernels.lowrank_add import resolve_backend
from glmtune.models.common.aux_loss import AuxiliaryLosses
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.common.step_runner import StepRunner
from glmtune.models.registry import hf_dir_identity, is_preset, model_spec
from glmtune.peft import apply_lora, build_inventory, export_run_adapters, print_inventory
from glmtune.peft.init import adapter_parameter_names, reset_lora_parameters
from glmtune.train.data_loader import PackedRowLoader
from glmtune.train.lr_schedule import build_scheduler
from glmtune.train.mix_loader import MixedRowLoader
from glmtune.train.metrics import MetricsWriter
from glmtune.train.optim import build_optimizer
from glmtune.train.distill_loss import distill_settings
from glmtune.train.preference import PreferenceObjective, pair_counts, preference_summary
from glmtune.train.precision import Precision, bf16_only_warning, bf16_rounded_away, resolve_precision
from glmtune.train.model_source import build_model_from_config, tokenizer_dir_for
from glmtune.train import reference_logps
from glmtune.train.process import DistributedInfo, check_recipe, init_distributed, resolve_device
from glmtune.train.run_data import PreparedData, prepare_data
from glmtune.train.run_dir import RunDirectory, check_writable, save_run_config
from glmtune.train.samples import prompts_from, run_samples, score
from glmtune.train.resume_state import null_settings
from glmtune.train.trainer import NextTokenUnits, NonFiniteLossError, Trainer, TrainerSettings


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _samples_table(before, after) -> Table:
    table = Table(title=f"held-out prompts: before -> after (3 of {len(after)} shown)", show_lines=True)
    table.add_column("ticket", max_width=40)
    table.add_column("reference", max_width=36)
    table.add_column("before", max_width=36)
    table.add_column("after", max_width=36)
    for b, a in list(zip(before, after))[:3]:  # all prompts are scored; three are shown
        # Model outputs and data are text, never rich markup ("[/x]" would raise) nor terminal escapes.
        after_cell = Text.assemble(("✓ ", "green") if a.exact else ("✗ ", "red"), printable(a.output or "(empty)"))
        table.add_row(Text(printable(b.prompt)), Text(printable(b.reference)), Text(printable(b.output or "(empty)")),
                      after_cell)
    return table


def _run_inputs(cfg: JobConfig) -> tuple[tuple[str, str], ...]:
    """(setting, path) of every file or directory the run reads that may lie in a run directory."""
    d = cfg.data
    named = [("model.name_or_path", cfg.model.name_or_path), ("data.tokenizer", d.tokenizer),
             ("data.chat_template", d.chat_template), ("data.json_schema", d.json_schema),
             *(("data.train", p) for p in d.train), *(("data.validation", p) for p in d.validation)]
    return tuple((key, str(value)) for key, value in named if value and not is_preset(value))


def _claim_run_dir(cfg: JobConfig, overwrite: bool, console: Console, resources: ExitStack,
                   claimed: list[RunDirectory]) -> str:
    """Rank 0: lock the run directory (released when the run ends; an --overwrite that did not commit
    is rolled back then), refuse a mixed run, prove it writable; the run id. The claim goes into
    `claimed` (the --overwrite's commit and the disk check ask it later)."""
    claim = RunDirectory(cfg.logging.run_dir, cfg.checkpoint.dir, console.print)
    claim.lock()
    resources.callback(claim.release)
    claimed.append(claim)
    run_id = claim.claim(config_to_yaml(cfg), cfg.checkpoint.resume, overwrite, _run_inputs(cfg), null_settings(cfg))
    check_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
    return run_id


def _check_disk_space(cfg: JobConfig, model: torch.nn.Module, console: Console, freed: dict[Path, int]) -> None:
    lora = cfg.peft.method != "none"
    needs = []
    # Without periodic saves or the one at the end, only a stop request would save: not planned for.
    if planned_saves(cfg, cfg.train.max_steps):
        needs.append((Path(cfg.checkpoint.dir), checkpoint_bytes(model, trainable_only=lora), "one checkpoint"))
    if cfg.checkpoint.export_hf and not lora:
        needs.append((Path(cfg.logging.run_dir) / "hf", export_bytes(model), "the HF export"))
    for warning in check_free_space(needs, cfg.checkpoint.keep_last, freed):
        console.print(f"[yellow]{warning}[/yellow]")


BASE_DIR = "base"  # RUN_DIR/base: the HF checkpoint of the preset base a run (SFT or LoRA) started from


def _write_preset_base(cfg: JobConfig, spec: ModelSpec, model: torch.nn.Module, out: Path, console: Console,
                       is_main: bool, freed: dict[Path, int]) -> dict | None:
    """Every rank (collective under torchrun; rank 0 writes), before LoRA and parallel wrapping:
    the preset's weights as an HF directory (with the tokenizer) that PEFT, `glmtune merge` and
    serving engines can load (the adapter's base), and `glmtune eval --base RUN_DIR` evaluates
    (the model before training, SFT or LoRA). Returns its identity on rank 0."""
    def check_space() -> None:  # rank 0; a refusal (ValueError) stops every rank alike
        for warning in check_free_space([(out, export_bytes(model), "the preset base")], keep_last=0, freed=freed):
            console.print(f"[yellow]{warning}[/yellow]")

    decide_on_rank0(check_space)
    spec.weights.save_pretrained(model, out, source_dir=resolve_tokenizer_dir(tokenizer_dir_for(cfg, None)), overwrite=True)
    if not is_main:
        return None
    role = "the adapter's base model" if cfg.peft.method == "lora" else "the model before training"
    console.print(f"wrote the {cfg.model.name_or_path} preset's base ({role}): {out}")
    return hf_dir_identity(out)


def step_model_flops(spec: ModelSpec, args, batches: list[dict]) -> float:
    """Model FLOPs of micro batches (the family's formula over their real documents; padding
    counts as one more document per row: the GPU computes it)."""
    lengths = [int(n) for b in batches for row in b["document_ids"]
               for n in torch.unique(row, return_counts=True)[1]]
    return spec.architecture.flops_per_token(args, lengths) * sum(lengths)


@dataclass
class RunHooks:
    """Callbacks into one run, for tools that watch it from inside (`glmtune preflight`)."""

    # The built model (LoRA applied), before data, parallel wrapping and training.
    on_model: Callable[[torch.nn.Module], None] | None = None
    # (step, model) once a step's gradients are complete: `TrainerSettings.on_gradients`.
    on_gradients: Callable[[int, torch.nn.Module], None] | None = None
    # (step, model, optimizer) after the optimizer's update, gradients still held:
    # `TrainerSettings.on_optimizer_step` (tests measure each rank's shards there).
    on_optimizer_step: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] | None = None


def run_training(cfg: JobConfig, overwrite: bool = False, hooks: RunHooks | None = None) -> int:
    """Train `cfg`. With `overwrite`, an earlier run in the same run directory is replaced."""
    console, hooks = Console(), hooks or RunHooks()
    with ExitStack() as resources:
        launch = check_launch(cfg)
        if launch.info.joined:  # torchrun's ranks: leaving without it can abort a rank at exit
            resources.callback(torch.distributed.destroy_process_group)
        # Between the steps: a Ctrl-C that native code swallowed stops the run all the same.
        claim = claim_run_directory(cfg, launch, overwrite, console, resources)
        raise_if_interrupted()
        built = build_model(cfg, launch, console, hooks, claim)
        raise_if_interrupted()
        data = prepare_run_data(cfg, launch, built, console)
        raise_if_interrupted()
        laid_out = lay_out_and_load(cfg, launch, built, data, console)
        attach_reference(cfg, launch, built, data, laid_out, console)
        raise_if_interrupted()
        trainer = build_trainer(cfg, launch, built, data, laid_out, claim, console, hooks)
        result = train(trainer, console)
        if result is None or result.interrupted:
            return 3 if result is None else 130
        return finish(cfg, launch, built, laid_out, result, console)


@dataclass
class Launch:
    """Step 1's answer: where and how this process runs, and the model family's front door."""

    spec: ModelSpec
    device: torch.device
    info: DistributedInfo
    degrees: MeshDegrees
    precision: Precision
    grad_accum: int
    run_dir: Path


def check_launch(cfg: JobConfig) -> Launch:
    """Join the process group, resolve the device, check the recipe (before anything is written).
    The recipe's check reads the model's architecture through its family's spec, which refuses an
    HF directory whose weights are not the model its config.json describes (every rank reads the
    same headers: the same sentence everywhere), so a refused model leaves no run directory."""
    device = resolve_device(cfg.train.device)
    info = init_distributed(device)
    if device.type == "cuda":
        device = resolve_device(cfg.train.device, info.local_rank)
    degrees = check_recipe(cfg, info.world_size, device)
    if cfg.data.kind == "chat":  # text documents (data.kind: text) render no template
        # a template whose turns glmtune cannot tell: refused (naming its file) before the model is built
        model_dir = None if is_preset(cfg.model.name_or_path) else Path(cfg.model.name_or_path)
        template_format_of(tokenizer_dir_for(cfg, model_dir))
    if cfg.peft.method == "lora":
        resolve_backend(cfg.peft.adapter_kernel, device)  # triton without CUDA: refused before anything is written
    return Launch(model_spec(cfg.model), device, info, degrees, resolve_precision(cfg),
                  grad_accum_steps(cfg, degrees), Path(cfg.logging.run_dir))


@dataclass
class Claim:
    """Step 2's answer: the run id every rank trains as, and rank 0's claim of the run directory."""

    run_id: str
    directory: RunDirectory | None  # rank 0 only
    pending_config: JobConfig | None = None  # a resume's resolved config, saved when it commits (rank 0)

    def freed(self) -> dict[Path, int]:
        """Bytes an --overwrite's set-aside run gives back when the run commits (rank 0)."""
        return self.directory.bytes_set_aside() if self.directory is not None else {}

    def commit(self) -> None:
        """Every check passed and the run trains: a resume's config and record are written (one refused
        before leaves the run's as they were), an --overwrite removes the run it set aside."""
        if self.directory is not None:
            if self.pending_config is not None:
                save_run_config(self.pending_config, self.directory.run_dir)
            self.directory.commit()


def claim_run_directory(cfg: JobConfig, launch: Launch, overwrite: bool, console: Console,
                        resources: ExitStack) -> Claim:
    """The run directory claimed on rank 0 (every rank learns the run id), the resolved config
    saved, the seeds set."""
    claimed: list[RunDirectory] = []
    run_id = decide_on_rank0(lambda: _claim_run_dir(cfg, overwrite, console, resources, claimed))
    directory = claimed[0] if claimed else None
    resumed = directory is not None and directory.continued
    if launch.info.is_main and not resumed:
        save_run_config(cfg, launch.run_dir)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    return Claim(run_id, directory, cfg if resumed else None)


@dataclass
class BuiltModel:
    """Step 3's answer: the model (LoRA applied) and where its base came from."""

    model: torch.nn.Module
    model_dir: Path | None  # the HF directory, None for a preset
    adapter_base: str | None  # the base an adapter names
    base_identity: dict | None
    base_hashing: Future | None  # an HF base's identity, hashed in the background
    sharded_load: bool  # built on the meta device, each rank loads its shards after parallelize


def build_model(cfg: JobConfig, launch: Launch, console: Console, hooks: RunHooks, claim: Claim) -> BuiltModel:
    """Build (or load) the model, write a preset's base, apply LoRA, log what trains."""
    info, run_dir = launch.info, launch.run_dir
    # An adapter names the exact base it was trained on (merge checks it): hash the base
    # directory in the background while the model loads and the data is prepared.
    base_hashing = None
    if cfg.peft.method == "lora" and info.is_main and not is_preset(cfg.model.name_or_path):
        base_hashing = ThreadPoolExecutor(1).submit(hf_dir_identity, cfg.model.name_or_path)
    # Never the whole model on one rank: under torchrun a run from an HF checkpoint is built on
    # the meta device and each rank reads only its own shards after parallelize (LoRA adapters
    # are then initialised to the values a one-process run draws).
    sharded_load = info.world_size > 1 and not is_preset(cfg.model.name_or_path)
    model, model_dir = build_model_from_config(cfg, "meta" if sharded_load else launch.device)
    adapter_base, base_identity = (str(model_dir) if model_dir is not None else None), None
    if model_dir is None:
        # A preset's random base exists nowhere else: the run writes it (before training changes
        # it), an adapter names it, and an evaluation compares against it.
        adapter_base = str((run_dir / BASE_DIR).resolve())
        base_identity = _write_preset_base(cfg, launch.spec, model, run_dir / BASE_DIR, console, info.is_main,
                                           claim.freed())
    # The MTP layer and the indexers train only with their losses (before LoRA and any wrapping).
    launch.spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    # LoRA is a transformation of the built model, before any parallel wrapping.
    inventory = apply_lora(model, cfg.peft, seed=cfg.train.seed) if cfg.peft.method == "lora" \
        else build_inventory(model)
    if hooks.on_model is not None:
        hooks.on_model(model)
    if info.is_main:
        print_inventory(inventory, console)  # what trains, by group: logged at the start of every run
        if cfg.model.fp8_base != "none":
            console.print(_fp8_summary(model))
        (run_dir / "trainable.json").write_text(json.dumps(inventory.to_dict(), indent=2) + "\n")
    return BuiltModel(model, model_dir, adapter_base, base_identity, base_hashing, sharded_load)


def prepare_run_data(cfg: JobConfig, launch: Launch, built: BuiltModel, console: Console) -> PreparedData:
    """Rank 0 writes the data files and the tokenization cache first; the others then read them.
    Rank 0 prepares inside `decide_on_rank0`: its refusal (a data contract error, a damaged cache
    entry, a base that cannot be hashed) stops every rank with its sentence at once, instead of
    leaving them at a barrier until the collective timeout."""
    info, run_dir = launch.info, launch.run_dir
    vocab_size = launch.spec.architecture.vocab_size(launch.spec.architecture.args_of(built.model))
    prepared: list[PreparedData] = []

    def prepare_on_rank0() -> None:  # rank 0 (every rank's answer is only "done", or the refusal)
        prepared.append(prepare_data(cfg, run_dir, tokenizer_dir_for(cfg, built.model_dir), vocab_size))
        if built.base_hashing is not None:
            built.base_identity = built.base_hashing.result()
        if cfg.peft.method == "lora" or built.base_identity is not None:
            write_run_record(run_dir, {**read_run_record(run_dir), "base": built.base_identity})

    decide_on_rank0(prepare_on_rank0)
    data = prepared[0] if prepared else prepare_data(cfg, run_dir, tokenizer_dir_for(cfg, built.model_dir), vocab_size)
    if info.is_main:
        (run_dir / "data_manifest.json").write_text(json.dumps(data.manifest, indent=2) + "\n")
        packing = data.manifest["train_packing"]
        unit = "preference pairs" if cfg.train.objective == "dpo" else "documents" if cfg.data.kind == "text" \
            else "conversations"
        console.print(f"data: {data.manifest['train_conversations']} train / "
                      f"{data.manifest['validation_conversations']} validation {unit} -> "
                      f"{packing['num_rows']} packed rows of {cfg.data.packed_sequence_size} "
                      f"({packing['num_tokens']:,} tokens)")
        for note in data.notes:  # rows the data pipeline dropped, truncated or deduplicated
            console.print(f"data: {note}")
    return data


@dataclass
class LaidOut:
    """Step 5's answer: the run's mesh and step runner, and the held-out prompts answered before training."""

    mesh: ParallelMesh | None  # None in one process without a process group
    runner: StepRunner  # what runs micro-batches through the parallelized model (the family's)
    tokenizer: Any
    template: str
    prompts: list
    before: list


def pipeline_options(cfg: JobConfig, launch: Launch) -> Any:
    """The model family's pipeline options for the run (None without pipeline parallelism): what
    the trainer and `glmtune plan --measure` parallelize with, the auxiliary losses' stages included."""
    if launch.degrees.pp == 1:
        return None
    p = cfg.parallel
    return launch.spec.compute.pipeline_options(
        schedule=p.pp_schedule, stages_per_rank=p.pp_stages_per_rank, microbatches=pipeline_microbatches(cfg),
        micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.packed_sequence_size,
        layer_split=p.pp_layer_split or None, dtype=launch.precision.compute_dtype, device=launch.device,
        mtp_loss_weight=cfg.train.mtp_loss_weight, indexer_loss_weight=cfg.train.indexer_loss_weight,
        distill_weight=cfg.distill.weight if cfg.train.objective == "distill" else 0.0, ep_overlap=p.pp_ep_overlap)


def lay_out_and_load(cfg: JobConfig, launch: Launch, built: BuiltModel, data: PreparedData,
                     console: Console) -> LaidOut:
    """The mesh and parallelize; the sharded load; the "before" samples (one model in one process,
    every rank on the sharded one)."""
    info, device, degrees, model = launch.info, launch.device, launch.degrees, built.model
    tokenizer_dir = tokenizer_dir_for(cfg, built.model_dir)
    tokenizer, template = load_tokenizer(tokenizer_dir), load_chat_template(resolve_tokenizer_dir(tokenizer_dir))
    prompts = prompts_from(data.val_conversations, cfg.train.generate_samples)
    before = run_samples(model, tokenizer, template, prompts) if prompts and info.is_main and not built.sharded_load \
        else []
    mesh = ParallelMesh(degrees, device_type=device.type) if torch.distributed.is_initialized() else None
    p = cfg.parallel
    spec = launch.spec
    pipeline = pipeline_options(cfg, launch)
    runner = spec.compute.parallelize(model, mesh, p, pipeline=pipeline)
    if degrees.pp > 1 and info.is_main:
        console.print(f"pipeline: {degrees.pp * p.pp_stages_per_rank} stages of "
                      f"{describe_split(spec.compute.layers_per_stage(model))} layers, {p.pp_schedule}, "
                      f"{pipeline.microbatches} microbatches per micro batch")
    if built.sharded_load:
        stats = spec.weights.load_sharded(model, built.model_dir, device, not_in_checkpoint=adapter_parameter_names(model))
        if cfg.peft.method == "lora":
            reset_lora_parameters(model, cfg.train.seed)
        if info.is_main:
            console.print(f"loaded {built.model_dir}, rank 0: {stats.describe()}")
        before = run_samples(model, tokenizer, template, prompts) if prompts else []  # every rank: sharded
    return LaidOut(mesh, runner, tokenizer, template, prompts, before)


def attach_reference(cfg: JobConfig, launch: Launch, built: BuiltModel, data: PreparedData, laid_out: LaidOut,
                     console: Console) -> None:
    """A full fine-tuning preference run's reference: the starting weights' log-probabilities of every
    row, read from the cache or computed now, before a resume loads a checkpoint (reference_logps.py)."""
    if not (cfg.train.objective == "dpo" and cfg.dpo.reference == "model" and cfg.peft.method == "none"):
        return
    cache = reference_logps
    train_rows, val_rows = data.train_rows, data.val_rows

    def locate() -> tuple[str, bool]:  # rank 0's view: its identity of the base, its cache directory
        if built.model_dir is None:  # a preset: its weights' hash (its base directory is the run's own)
            starting = {k: built.base_identity[k] for k in ("config_sha256", "weights_sha256")}
        else:
            starting = cache.model_files_identity(Path(built.model_dir))
        compute = {"model": config_to_dict(cfg)["model"], "compute_dtype": str(launch.precision.compute_dtype)}
        path = cache.cache_path(cfg.data.cache_dir, cache.cache_key(starting, compute, train_rows, val_rows))
        return str(path), path.is_file()

    path_text, cached = decide_on_rank0(locate)
    path = Path(path_text)
    if cached:  # read by rank 0 and handed to every rank: other nodes need not see its cache directory
        train_values, val_values = decide_on_rank0(lambda: cache.load(path, train_rows, val_rows))
        said = (f"reused from the cache, key {path.stem} (the starting weights' names, sizes, mtimes and "
                f"sampled content, the model settings, the rows): {path}")
    else:
        start = time.perf_counter()
        mesh = laid_out.mesh
        score = functools.partial(cache.compute, laid_out.runner, micro_batch=cfg.train.micro_batch_size,
                                  group=mesh.group("dp") if mesh is not None else None)
        train_values, val_values = score(train_rows), score(val_rows)
        if launch.info.is_main:
            cache.save(path, train_values, val_values, {"rows": len(train_rows) + len(val_rows)})
        barrier()
        said = f"computed from the starting weights in {time.perf_counter() - start:.1f} s, cached at {path}"
    cache.attach(train_rows, train_values)
    cache.attach(val_rows, val_values)
    if launch.info.is_main:
        console.print(f"reference log-probabilities of {len(train_rows) + len(val_rows)} rows: {said}")


def _loaders(cfg: JobConfig, data: PreparedData, mesh: ParallelMesh | None, dp_size: int):
    """This rank's training rows, and the validation rows when every rank gets a micro batch."""
    dp_rank = mesh.dp_rank if mesh is not None else 0
    train_loader = PackedRowLoader(data.train_rows, cfg.train.micro_batch_size, cfg.train.seed, dp_rank, dp_size) \
        if data.mix is None else MixedRowLoader(data.train_rows, data.mix, cfg.train.micro_batch_size, cfg.train.seed,
                                                dp_rank, dp_size)
    val_loader = None
    if data.val_rows and len(data.val_rows) >= cfg.train.micro_batch_size * dp_size:
        val_loader = PackedRowLoader(data.val_rows, cfg.train.micro_batch_size, cfg.train.seed, dp_rank, dp_size,
                                     shuffle=False)
    return train_loader, val_loader


def mix_settings(cfg: JobConfig, settings: TrainerSettings, data: PreparedData, train_loader,
                 mesh: ParallelMesh | None, dp_size: int) -> TrainerSettings:
    """A replay mix's settings: the realized mix logged per window (mix/<source>), and the replay's own
    validation rows validated beside the run's (val_loss/replay) when every rank gets a micro batch."""
    if data.mix is None:
        return settings
    dp_rank = mesh.dp_rank if mesh is not None else 0
    loaders = {name: PackedRowLoader(rows, cfg.train.micro_batch_size, cfg.train.seed, dp_rank, dp_size,
                                     shuffle=False)
               for name, rows in data.mix.val_rows.items()
               if name != data.mix.names[0] and len(rows) >= cfg.train.micro_batch_size * dp_size}
    return dataclasses.replace(settings, window_metrics=train_loader.window_mix, source_val_loaders=loaders)


def trainer_settings(cfg: JobConfig, launch: Launch, model, mesh: ParallelMesh | None,
                      hooks: RunHooks) -> TrainerSettings:
    degrees, device, info, spec = launch.degrees, launch.device, launch.info, launch.spec
    shared_rows = degrees.pp > 1 or degrees.cp > 1  # ranks beyond the data-parallel ones read the same rows
    return TrainerSettings(
        max_steps=cfg.train.max_steps, grad_accum=launch.grad_accum, clip_grad_norm=cfg.train.clip_grad_norm,
        log_every=cfg.train.log_every, val_every=cfg.train.val_every, val_steps=cfg.train.val_steps,
        checkpoint_every=cfg.checkpoint.every_steps, save_at_end=cfg.checkpoint.save_at_end,
        router_bias_update=cfg.train.router_bias_update,
        router_bias_rate=cfg.train.router_bias_update_rate, device=device,
        progress=cfg.logging.progress and info.is_main, async_save=cfg.checkpoint.async_save,
        stop_file=launch.run_dir / STOP_FILE,
        row_group=mesh.group("dp") if shared_rows else None, stage_group=mesh.group("loss") if degrees.pp > 1 else None,
        pp_group=mesh.group("pp") if degrees.pp > 1 else None,
        step_flops=functools.partial(step_model_flops, spec, spec.architecture.args_of(model)),
        moe_layers=spec.compute.moe_layers(model),
        peak_tflops=peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None,
        on_gradients=hooks.on_gradients,
        on_optimizer_step=hooks.on_optimizer_step,
    )


def objective(cfg: JobConfig, settings: TrainerSettings) -> TrainerSettings:
    """The trainer settings of `train.objective`: SFT's next-token loss (the model family's), its
    auxiliary losses and indexer warm-up, or the preference objective (its loss of the rows, pairs as
    its unit, its statistics logged as dpo/...)."""
    if cfg.train.objective == "sft":
        t = cfg.train
        if t.mtp_loss_weight == 0 and t.indexer_loss_weight == 0:
            return settings
        return dataclasses.replace(
            settings, auxiliary=AuxiliaryLosses(t.mtp_loss_weight, t.indexer_loss_weight),
            unit_counts=NextTokenUnits(mtp=t.mtp_loss_weight > 0, queries=t.indexer_loss_weight > 0),
            indexer_warmup_steps=t.indexer_warmup_steps, router_bias_after=t.indexer_warmup_steps)
    if cfg.train.objective == "distill":  # SFT's loss plus the teacher's KL (distill_loss.py)
        return distill_settings(cfg.distill, settings)
    preference = PreferenceObjective(cfg.dpo, lora=cfg.peft.method == "lora")
    return dataclasses.replace(settings, unit_counts=pair_counts, rows_loss=preference, prepare=preference.prepare,
                               stats_prefix="dpo/")


def build_trainer(cfg: JobConfig, launch: Launch, built: BuiltModel, data: PreparedData, laid_out: LaidOut,
                  claim: Claim, console: Console, hooks: RunHooks) -> Trainer:
    """Optimizer, schedule, loaders, checkpoints, metrics and the trainer; resumed as the recipe says.
    The last check before training: an --overwrite then removes the run it set aside."""
    info, model, o, mesh = launch.info, built.model, cfg.optim, laid_out.mesh
    # collective: every rank counts its shard (bf16-only training; fp32 masters move every weight)
    rounded_away = None if launch.precision.masters else bf16_rounded_away(model, cfg.optim.lr)
    if rounded_away is not None and info.is_main:
        console.print(f"[yellow]{bf16_only_warning(rounded_away, cfg.optim.lr)}[/yellow]")
    optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.fused, masters=launch.precision.masters)
    scheduler = build_scheduler(optimizer, o.warmup_steps_for(cfg.train.max_steps), cfg.train.max_steps, o.scheduler,
                                o.min_lr_ratio)
    train_loader, val_loader = _loaders(cfg, data, mesh, launch.degrees.dp)
    # DCP's asynchronous save collects its plan from a background thread on a CPU-capable group.
    async_group = mesh.cpu_group() if cfg.checkpoint.async_save and mesh is not None else None
    checkpoints = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep_last,
                                    trainable_only=cfg.peft.method != "none", run_id=claim.run_id,
                                    async_group=async_group)
    decide_on_rank0(lambda: _check_disk_space(cfg, model, console, claim.freed()))
    metrics = MetricsWriter(launch.run_dir, cfg.logging.metrics_file, cfg.logging.tensorboard, enabled=info.is_main,
                            wandb_project=cfg.logging.wandb, run_name=cfg.name, config=config_to_dict(cfg),
                            mlflow_uri=cfg.logging.mlflow)
    settings = objective(cfg, trainer_settings(cfg, launch, model, mesh, hooks))
    settings = mix_settings(cfg, settings, data, train_loader, mesh, launch.degrees.dp)
    trainer = Trainer(model, optimizer, scheduler, laid_out.runner, train_loader, val_loader, checkpoints, metrics,
                      settings, console if info.is_main else None)
    if trainer.resume(cfg.checkpoint.resume) == 0 and info.is_main:
        metrics.truncate_after(0)  # a fresh run starts a fresh metrics file
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    initial_val = trainer.validate() if trainer.step == 0 else None  # every rank: sharded forward
    initial_sources = trainer.validate_sources() if trainer.step == 0 else {}  # a replay mix's general data
    if info.is_main:
        console.print(f"model: {cfg.model.name_or_path}, {trainable:,} trainable parameters (this rank's "
                      f"shard when sharded); {launch.precision.describe()}; {launch.degrees.describe()}; "
                      f"grad_accum {launch.grad_accum}; run dir {launch.run_dir}")
        if initial_val is not None:
            console.print(f"validation loss before training: {initial_val:.4f}{preference_summary(trainer.val_stats)}")
        for key, loss in initial_sources.items():
            console.print(f"validation loss before training, {key.split('/', 1)[1]}: {loss:.4f}")
        if _weights_not_kept(cfg):
            console.print("[yellow]checkpoint.save_at_end is false with checkpoint.every_steps 0 and "
                          "checkpoint.export_hf false: the trained weights will not be kept[/yellow]")
    raise_if_interrupted()  # the last moment at which the earlier run is still set aside
    decide_on_rank0(claim.commit)
    return trainer


def _weights_not_kept(cfg: JobConfig) -> bool:
    """No checkpoint, HF export or LoRA adapter will hold the trained weights when the run ends."""
    c = cfg.checkpoint
    return not (c.save_at_end or c.every_steps or c.export_hf or cfg.peft.method == "lora")


def train(trainer: Trainer, console: Console):
    """The loop; None when a non-finite loss stopped it (said, with the last good checkpoint)."""
    try:
        return trainer.fit()
    except NonFiniteLossError as exc:
        latest = trainer.checkpoints.latest()
        kept = f"last good checkpoint: {latest.path}" if latest else "no checkpoint was written"
        console.print(f"[red]stopped: {exc}; nothing was saved for this step; {kept}[/red]")
        return None
    finally:
        trainer.metrics.close()


def finish(cfg: JobConfig, launch: Launch, built: BuiltModel, samples: LaidOut, result, console: Console) -> int:
    """The "after" samples and what the run ships. Every rank runs this (sharded forwards and
    gathers are collective); only rank 0 prints and writes."""
    info, run_dir, model, mesh = launch.info, launch.run_dir, built.model, samples.mesh
    pp_group = mesh.group("pp") if launch.degrees.pp > 1 else None
    after = run_samples(model, samples.tokenizer, samples.template, samples.prompts) if samples.prompts else []
    if result.last_loss is None:  # resumed at max_steps: nothing was trained in this process
        if info.is_main:
            console.print(f"already at train.max_steps ({result.step}); nothing to train. Raise "
                          "--train.max_steps to continue; outputs of the finished run are left as they are")
        return 0
    if info.is_main:
        console.print(f"finished step {result.step}: train loss {result.last_loss:.4f}"
                      + (f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
                      + preference_summary(result.val_stats))
        if samples.prompts:
            _report_samples(samples.before, after, run_dir, console)
    if cfg.peft.method == "lora":
        for layout, out in export_run_adapters(model, run_dir, base_model_name_or_path=built.adapter_base,
                                               base_identity=built.base_identity, pp_group=pp_group).items():
            if info.is_main:
                console.print(f"exported LoRA adapter ({layout} layout): {out}")
    if cfg.checkpoint.export_hf and cfg.peft.method == "none":
        out = launch.spec.weights.save_pretrained(model, run_dir / "hf",
                                          source_dir=resolve_tokenizer_dir(tokenizer_dir_for(cfg, built.model_dir)),
                                          overwrite=True, dtype=launch.precision.compute_dtype,
                                          pp_group=pp_group)
        if info.is_main:
            console.print(f"exported HF checkpoint: {out}")
    return 0


def _report_samples(before: list, after: list, run_dir: Path, console: Console) -> None:
    console.print(_samples_table(before, after))
    b, a = score(before), score(after)
    console.print(f"held-out exact answers: {b['exact']:.0%} before -> {a['exact']:.0%} after; "
                  f"valid JSON: {b['valid_json']:.0%} -> {a['valid_json']:.0%}")
    (run_dir / "samples.json").write_text(json.dumps(
        {"before": b, "after": a, "outputs": [vars(r) for r in after]}, indent=2) + "\n")


def _fp8_summary(model) -> str:
    fp8 = [p for p in model.parameters() if is_fp8(p)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return (f"model: frozen FP8 base, {len(fp8)} e4m3 tensors with 128x128 scales "
            f"({human_bytes(sum(p.numel() for p in fp8))} of {human_bytes(total)} of parameters)")
