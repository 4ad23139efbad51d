"""From a resolved `JobConfig` to the pieces a run needs: model, data, trainer.

`run_training(cfg)` is what `glmtune train` calls: it saves the resolved config in
the run directory, builds the model (a preset or a local HF directory), prepares
the data (synthetic generation, contract check, PII policy, exact dedup,
group-aware split, tokenization through the cache, packing), trains, and exports.
Each builder is usable alone (`build_model_from_config`, `prepare_data`) by other
commands.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from glmtune.checkpoint.hf_io import load_pretrained
from glmtune.config import JobConfig, dump_config, model_dims, validate_config
from glmtune.data.contract import check_or_raise, load_schema
from glmtune.data.dedup import dedup_rows
from glmtune.data.packing import pack_samples
from glmtune.data.pii import build_report, lint_rows
from glmtune.data.sources import check_format, no_rows_message, read_rows
from glmtune.data.split import split_rows
from glmtune.data.synthetic import generate_rows, write_jsonl
from glmtune.data.token_cache import tokenize_dataset
from glmtune.data.tokenizer import load_tokenizer
from glmtune.distributed.pipeline_plan import V_SCHEDULES
from glmtune.models.glm5.args import Glm5Args, PRESETS, get_preset
from glmtune.models.glm5.attention import set_attention_score_buffer
from glmtune.models.glm5.fp8_base import convert_to_fp8_base
from glmtune.models.glm5.model import Glm5ForCausalLM, build_model
from glmtune.models.glm5.moe import set_moe_dispatch_backend
from glmtune.train.precision import resolve_precision


@dataclass
class DistributedInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # this call created the process group (the run destroys it when it ends)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistributedInfo:
    """Join the process group when launched by torchrun/Slurm (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedInfo()
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), joined)


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device: cuda requested but no CUDA device is available")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_model_from_config(cfg: JobConfig, device: torch.device | str = "cpu",
                            seed: int | None = None) -> tuple[Glm5ForCausalLM, Path | None]:
    """The model `cfg.model` names and the HF directory it came from (None for presets), its
    parameters in the run's parameter dtype (fp32 under fp32 master weights: `precision.py`).

    With `device="meta"` and an HF directory nothing is read: the model has the
    checkpoint's architecture and no storage, for `load_sharded` after `parallelize_glm5`.
    """
    m = cfg.model
    dtype = resolve_precision(cfg).param_dtype
    if m.name_or_path in PRESETS:
        args = get_preset(m.name_or_path)
        if m.overrides:
            args = args.replace(**m.overrides)
        model = build_model(args, dtype, device, m.attention_backend, m.moe_backend,
                            seed=cfg.train.seed if seed is None else seed, indexer_backend=m.indexer_backend)
        set_moe_dispatch_backend(model, m.moe_dispatch_backend)
        set_attention_score_buffer(model, m.attention_score_buffer_mib)
        return model, None
    if m.overrides:
        raise ValueError("model.overrides apply to presets only; edit the checkpoint's config.json instead")
    path = Path(m.name_or_path)
    if str(device) == "meta":
        model = build_model(Glm5Args.from_hf_config(path), dtype, "meta", m.attention_backend, m.moe_backend,
                            indexer_backend=m.indexer_backend)
        if m.fp8_base != "none":  # load_sharded fills the e4m3 weights and their scales as stored

            convert_to_fp8_base(model, m.fp8_base)
    else:
        model = load_pretrained(path, dtype, device, m.attention_backend, m.moe_backend,
                                indexer_backend=m.indexer_backend, fp8_base=None if m.fp8_base == "none" else m.fp8_base)
    set_moe_dispatch_backend(model, m.moe_dispatch_backend)
    set_attention_score_buffer(model, m.attention_score_buffer_mib)
    return model, path


def tokenizer_dir_for(cfg: JobConfig, model_dir: Path | None) -> Path | None:
    """The tokenizer: data.tokenizer, else the model directory's, else the bundled tiny one."""
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    return model_dir


@dataclass
class PreparedData:
    train_rows: list[dict[str, list[int]]]
    val_rows: list[dict[str, list[int]]]
    val_conversations: list[dict[str, Any]]
    manifest: dict[str, Any]
    notes: list[str]  # one console line per thing the filters removed or changed (also in the manifest)


def _write_jsonl(rows: list[dict[str, Any]], directory: Path, split: str) -> Path:
    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    path = directory / f"{split}-{digest}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(body)
        tmp.replace(path)
    return path


def prepare_data(cfg: JobConfig, run_dir: Path, tokenizer_dir: Path | None, vocab_size: int) -> PreparedData:
    """Read, check, filter, split, tokenize and pack the recipe's data.

    Every training row must pass the data contract (a bad row, an undecodable line
    included, fails the run before anything trains, listed as file:line). Then, in
    `glmtune data prepare`'s order: the PII policy, exact dedup (only exact: see
    dedup.py), the group split, and packing with `data.too_long`. What each filter
    removed is counted in the manifest and described in `notes`; a filter that
    leaves nothing to train on is a ValueError naming it.
    """
    d = cfg.data
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    train_paths = [Path(p) for p in d.train]
    if d.synthetic is not None:
        synthetic = data_dir / f"synthetic-{d.synthetic.kind}-{d.synthetic.rows}-seed{d.synthetic.seed}.jsonl"
        if not synthetic.exists():  # written under a temporary name: a killed run leaves no partial file
            tmp = synthetic.with_suffix(".partial")
            write_jsonl(generate_rows(d.synthetic.rows, d.synthetic.seed), tmp)
            tmp.replace(synthetic)
        train_paths.append(synthetic)
    if not train_paths:
        raise ValueError("data.train is empty and data.synthetic is not set: nothing to train on")
    check_format([*d.train, *d.validation], d.format)
    schema = load_schema(d.json_schema) if d.json_schema else None
    rows = check_or_raise(read_rows(train_paths), schema)  # every row, before any training
    if not rows:
        raise ValueError(f"data.train: {no_rows_message(train_paths)}: nothing to train on")
    notes: list[str] = []
    num_input_rows = len(rows)
    rows = _apply_pii_policy(rows, d.pii, run_dir, notes)
    num_pii_dropped = num_input_rows - len(rows)
    rows, dedup_stats = dedup_rows(rows, normalized=False)
    if dedup_stats.num_exact_duplicates:
        notes.append(f"removed {dedup_stats.num_exact_duplicates:,} exact duplicate conversations "
                     f"(kept the first of each; {len(rows):,} left)")
    if d.validation:
        val_paths = [Path(p) for p in d.validation]
        val_data = [r.data for r in check_or_raise(read_rows(val_paths), schema)]
        if not val_data:
            raise ValueError(f"data.validation: {no_rows_message(val_paths)}; "
                             "leave data.validation empty to carve validation rows from data.train")
        train_data = [r.data for r in rows]
    else:
        ratios = (d.split.get("train", 0.0), d.split.get("validation", 0.0), d.split.get("test", 0.0))
        parts = split_rows(rows, ratios, seed=cfg.train.seed)
        train_data = [r.data for r in parts["train"]]
        val_data = [r.data for r in parts["validation"]]
        if not train_data:
            raise ValueError(f"data.split {d.split} sent all {len(rows):,} rows to validation/test (rows of one "
                             "`group` stay together, so few groups split coarsely): nothing left to train on; "
                             "add rows or give data.validation files")
        val_paths = [_write_jsonl(val_data, data_dir, "validation")] if val_data else []
    train_file = _write_jsonl(train_data, data_dir, "train")
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    options = dict(tokenizer_dir=tokenizer_dir, loss_on=d.loss_on, enable_thinking=d.enable_thinking,
                   schema=schema, cache_dir=d.cache_dir)
    train_tok = tokenize_dataset([train_file], **options)
    train_rows, train_stats = pack_samples(train_tok.samples, d.packed_sequence_size,
                                          pad_token_id=tokenizer.pad_token_id, long_samples=d.too_long)
    packing_notes = _packing_notes(train_stats, "training", d.packed_sequence_size, d.too_long)
    if not train_rows:
        advice = "; raise data.packed_sequence_size" + (" or set data.too_long: truncate"
                                                         if train_stats.num_dropped_too_long else "")
        raise ValueError(f"nothing left to train on: {'; '.join(packing_notes)}{advice}")
    notes += packing_notes
    val_rows, val_stats = [], None
    if val_paths:
        val_tok = tokenize_dataset(val_paths, **options)
        val_rows, val_stats = pack_samples(val_tok.samples, d.packed_sequence_size,
                                           pad_token_id=tokenizer.pad_token_id, long_samples=d.too_long)
        notes += _packing_notes(val_stats, "validation", d.packed_sequence_size, d.too_long)
    manifest = {
        "train_file": str(train_file), "train_conversations": len(train_data),
        "validation_conversations": len(val_data), "validation_files": [str(p) for p in val_paths],
        "tokenization_key": train_tok.key,
        "cache_hit": train_tok.cache_hit,
        "filters": {"input_rows": num_input_rows, "pii_dropped": num_pii_dropped,
                    "exact_duplicates": dedup_stats.num_exact_duplicates},
        "train_packing": vars(train_stats), "validation_packing": vars(val_stats) if val_stats else None,
        "notes": notes,
    }
    return PreparedData(train_rows, val_rows, val_data, manifest, notes)


def _packing_notes(stats: Any, split: str, size: int, too_long: str) -> list[str]:
    """What packing (its PackingStats) removed or cut from one split's conversations, one line each."""
    total, longest = f"{stats.num_samples:,} {split} conversations", f"longest {stats.longest_sample:,} tokens"
    notes = []
    if stats.num_dropped_too_long:
        notes.append(f"dropped {stats.num_dropped_too_long:,} of {total} longer than data.packed_sequence_size "
                     f"{size} (data.too_long: {too_long}; {longest})")
    if stats.num_truncated:
        notes.append(f"truncated {stats.num_truncated:,} of {total} longer than data.packed_sequence_size "
                     f"{size} to their first {size} tokens (data.too_long: {too_long}; {longest})")
    if stats.num_dropped_no_targets:
        notes.append(f"dropped {stats.num_dropped_no_targets:,} of {total} with no assistant token left to train on"
                     + (" after truncation" if stats.num_truncated else ""))
    return notes


def _apply_pii_policy(rows: list, action: str, run_dir: Path, notes: list[str]) -> list:
    """Secrets/PII lint on the training rows: report (write pii_report.json), drop the rows, or fail."""
    per_row = lint_rows(rows)
    report = build_report(per_row, action)
    report_path = run_dir / "pii_report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    if not report["num_findings"]:
        return rows
    first = next(f for findings in per_row for f in findings)
    num_flagged = report["num_rows_with_findings"]
    if action == "fail":
        raise ValueError(f"{first} (and {report['num_findings'] - 1} more findings; data.pii is 'fail'; "
                         f"report in {report_path})")
    if action == "drop":
        if num_flagged == len(rows):
            raise ValueError(f"data.pii is 'drop' and every one of the {len(rows):,} training rows has secret/PII "
                             f"findings (report in {report_path}): nothing left to train on")
        notes.append(f"dropped {num_flagged:,} of {len(rows):,} rows with secret/PII findings "
                     f"(data.pii: drop; report in {report_path})")
        return [row for row, findings in zip(rows, per_row) if not findings]
    notes.append(f"kept {num_flagged:,} rows with secret/PII findings (data.pii: report; "
                 f"{report['num_findings']:,} findings in {report_path})")
    return rows


def glm5_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"],
                compute_logits=False, targets=batch["targets"], longest_document=batch.get("longest_document"),
                num_supervised=batch.get("num_supervised"), loss_grad_scale=batch.get("loss_grad_scale"),
                single_document=batch.get("single_document"))
    return out.loss_sum, out.num_targets


def check_recipe(cfg: JobConfig, world_size: int):
    dims = model_dims(cfg.model)
    degrees = validate_config(cfg, dims.num_experts, dims.num_layers, world_size=world_size)
    _check_torch_supports(cfg)
    return degrees


# The V-shaped schedules train exactly on torch 2.13 (tests/distributed/test_pipeline_train.py);
# on torch 2.11 ZBVZeroBubble failed in its stage initialisation (gloo, 2 ranks, H200 image).
V_SCHEDULES_FROM = (2, 13)


def _check_torch_supports(cfg: JobConfig) -> None:
    p = cfg.parallel
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES and version < V_SCHEDULES_FROM:
        raise ValueError(f"parallel.pp_schedule {p.pp_schedule} needs torch >= 2.13 here (this is torch "
                         f"{torch.__version__}: on 2.11 its stage initialisation fails); use Interleaved1F1B or "
                         "InterleavedZeroBubble, or upgrade torch")


def save_run_config(cfg: JobConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
