"""`glmtune export RUN_DIR --adapter OUT | --hf OUT`: a run's adapter, or a full fine-tune's model.

`--adapter OUT [--layout peft|per_expert]` (a LoRA run) rebuilds the run's model from
RUN_DIR/config.yaml, applies its LoRA config, loads the adapters from the newest complete
checkpoint (or `--checkpoint step-N`), and writes them in PEFT's format: `peft` (default)
loads with `peft.PeftModel.from_pretrained` on transformers' GlmMoeDsaForCausalLM;
`per_expert` is the layout vLLM and SGLang load (docs/lora.md). The base weights play no part
in an adapter, so the model is built on the meta device and only the adapters (and buffers
the checkpoint holds) are materialized: exporting a GLM-5 run needs megabytes of memory, not
the 1.5 TB base.

`--hf OUT [--max-shard-size 5GB]` (a full fine-tuning run) writes the checkpoint's weights as
the HF directory the run's end-of-training export (`checkpoint.export_hf`, RUN_DIR/hf) writes,
bit for bit, shard by shard (glmtune/checkpoint/export_stream.py): the model is built on the
meta device and the checkpoint read a bounded group of tensors at a time, so peak host memory
is about one output shard + one group of tensors as stored, whatever the model's size.

Both write the model card, OUT/README.md (glmtune/release/model_card.py): front matter with the
base, the method and the data's provenance, and sections generated from the run's records.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

_EXAMPLES = """examples:
  glmtune export runs/tiny-lora-support-json --adapter out/adapter
  glmtune export runs/tiny-lora-support-json --adapter out/adapter_vllm --layout per_expert
  glmtune export runs/tiny-sft-support-json --hf out/model --checkpoint runs/tiny-sft-support-json/checkpoints/step-00000200
"""


# The adapter layouts of glmtune/peft/adapter_export.py (`LAYOUTS`), named here because importing it
# (torch) would make `glmtune --help` wait for torch; tests/cli/test_torch_free.py holds the two equal.
ADAPTER_LAYOUTS = ("peft", "per_expert")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a LoRA run's adapter (PEFT format) or a full fine-tuning run's model (HF format)",
        description="Write, from a run's newest checkpoint, the adapter of a LoRA run as adapter_config.json + "
                    "adapter_model.safetensors (--adapter), or the model of a full fine-tuning run as an HF "
                    "directory, shard by shard (--hf).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding config.yaml and checkpoints")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--adapter", metavar="OUT", help="a LoRA run: directory to write the adapter to")
    target.add_argument("--hf", metavar="OUT", help="a full fine-tuning run: directory to write the HF model to")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it is an earlier glmtune export of the same kind (never anything "
                             "else, never inside a run directory, never an input: RUN_DIR, the checkpoint, or the "
                             "run's base model)")
    parser.add_argument("--layout", choices=ADAPTER_LAYOUTS, default=None,
                        help="with --adapter: peft: PeftModel.from_pretrained on transformers (default); "
                             "per_expert: vLLM / SGLang per-expert keys (the default with --engine)")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default=None,
                        help="with --adapter: check the adapter against what this engine applies (refused, with "
                             "the fix, when it would differ from training) and print the command that serves it")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="with --hf: largest safetensors file, e.g. 5GB (default), 500MB; tensors are never "
                             "split. Peak memory is about this + one group of checkpoint tensors of this size")
    parser.add_argument("--checkpoint", metavar="STEP_DIR", default=None,
                        help="a step-N checkpoint directory (default: the newest complete one)")
    parser.set_defaults(func=_run)


def checkpoint_root(cfg, run_dir: Path) -> Path:
    """Where the run's checkpoints are: RUN_DIR/checkpoints, else checkpoint.dir as recorded.

    RUN_DIR first: the recorded path is relative to wherever training ran, and a run
    directory that was moved or copied keeps its own checkpoints. The recorded path
    covers a checkpoint.dir set outside the run directory.
    """
    local = run_dir / "checkpoints"
    recorded = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if not local.is_dir() and recorded is not None and recorded.is_dir():
        return recorded
    return local


def adapter_model(cfg):
    """The run's model on meta with its LoRA adapters (and buffers) materialized on CPU."""
    import torch
    from torch import nn

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.models.registry import model_args, model_spec
    from glmtune.peft import apply_lora

    spec = model_spec(cfg.model)
    model = spec.weights.build(model_args(cfg.model), getattr(torch, cfg.model.dtype), "meta")
    # a run with the MTP loss adapted its MTP layer too (glmtune/peft/apply.py): the same adapters here
    spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    apply_lora(model, cfg.peft)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad:  # the adapters; loaded from the checkpoint below
                setattr(module, name, nn.Parameter(torch.zeros(param.shape, dtype=param.dtype)))
        for name, buf in list(module.named_buffers(recurse=False)):
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype), persistent=persistent)
    return model


def run_base_dir(cfg, run_dir: Path) -> Path:
    """The base model directory a LoRA run trained on: RUN_DIR/base for a preset (the run wrote
    it there), else model.name_or_path."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.models.registry import is_preset

    return run_dir / "base" if is_preset(cfg.model.name_or_path) else Path(cfg.model.name_or_path)


def _check_base_unchanged(base_dir: Path, recorded: dict | None) -> None:
    """The run's base directory must still hold the model it trained on (by config: the
    adapter's shapes follow it). Its weights are compared by `glmtune merge`, which reads them anyway."""
    if not recorded or recorded.get("kind") != "hf_dir":
        return
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.checkpoint.fingerprint import config_sha256
    from glmtune.models.registry import spec_for

    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"the run's base {base_dir} has no config.json any more; restore the base the run "
                                "trained on (model.name_or_path in the run's config.yaml, or RUN_DIR/base for a "
                                "preset)")
    if config_sha256(spec_for(base_dir).architecture.args_from_hf(base_dir)) != recorded["config_sha256"]:
        raise ValueError(f"the base {base_dir} changed since the run trained on it (its config.json describes another "
                         "model); restore the base the run trained on, or the adapter will not fit it")


def _run(ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.checkpoint.manager import CheckpointManager
    from glmtune.config import load_run_config
    from glmtune.io.run_lock import read_run_record

    run_dir = Path(ns.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a glmtune run directory)")
    cfg = load_run_config(run_dir / "config.yaml")
    full = cfg.peft.method == "none"
    if ns.adapter is not None and cfg.peft.method != "lora":
        raise ValueError(f"{run_dir}: peft.method is {cfg.peft.method!r}; only LoRA runs have an adapter "
                         "(export a full fine-tuning run's model with --hf OUT)")
    if ns.hf is not None and (ns.engine or ns.layout):
        raise ValueError(f"--{'engine' if ns.engine else 'layout'} applies to --adapter; --hf writes the model, "
                         "which every engine loads as an HF directory")
    if ns.hf is not None and not full:
        raise ValueError(f"{run_dir}: peft.method is {cfg.peft.method!r}: its checkpoints hold the adapter only; "
                         "export it with --adapter OUT, or merge it into its base with `glmtune merge`")
    record = read_run_record(run_dir)  # None for runs from before run records
    run_id = record["run_id"] if record else None
    manager = CheckpointManager(checkpoint_root(cfg, run_dir), trainable_only=not full, run_id=run_id)
    checkpoint = manager.resolve(ns.checkpoint) if ns.checkpoint else manager.latest()
    if checkpoint is None:
        raise FileNotFoundError(f"{manager.root}: no complete checkpoint of this run to export from")
    if run_id and checkpoint.run_id and checkpoint.run_id != run_id:
        raise ValueError(f"--checkpoint {checkpoint.path} was written by another run (run id {checkpoint.run_id}) "
                         f"than {run_dir} (run id {run_id}); export that checkpoint's own run directory")
    if full:
        return _export_model(ns, cfg, run_dir, manager, checkpoint)
    return _export_adapter(ns, cfg, run_dir, record, manager, checkpoint)


def _check_intact(manager, checkpoint) -> None:
    problems = manager.verify(checkpoint)
    if problems:
        raise ValueError(f"checkpoint {checkpoint.path} is damaged: {problems[0]}; choose another with --checkpoint")


def _export_adapter(ns: argparse.Namespace, cfg, run_dir: Path, record: dict | None, manager, checkpoint) -> int:
    import torch

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.outputs import check_output
    from glmtune.peft import export_adapter
    from glmtune.peft.engines import serve_command

    base_dir = run_base_dir(cfg, run_dir)
    # Everything this command reads; --adapter may be none of them, --overwrite or not.
    sources = (("RUN_DIR", run_dir), ("checkpoint", checkpoint.path), ("the run's base", base_dir))
    check_output(ns.adapter, overwrite=ns.overwrite, sources=sources, what="--adapter")
    base = record.get("base") if record else None
    _check_base_unchanged(base_dir, base)
    _check_intact(manager, checkpoint)
    model = adapter_model(cfg)
    layout = ns.layout or ("per_expert" if ns.engine else "peft")
    engine = _check_engine(ns.engine, model, cfg.peft, layout) if ns.engine else None
    # The checkpoint holds optimizer state too; DCP needs an optimizer of the same shape.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    manager.load(checkpoint, model, optimizer)
    # The adapter names its base as training did: a preset's is the directory the run wrote.
    named_base = str(base_dir.resolve()) if base_dir == run_dir / "base" and base_dir.is_dir() \
        else cfg.model.name_or_path
    out = export_adapter(model, ns.adapter, layout, named_base, overwrite=ns.overwrite, sources=sources,
                         base_identity=base)
    print(f"exported {layout} adapter from {checkpoint.path} (step {checkpoint.step}) to {out}")
    _write_card(run_dir, Path(out), base_dir, "adapter")
    if engine is not None:
        facts, traits, notes = engine
        print(f"serve it with {facts.name} (facts checked against {facts.name} {facts.checked}, docs/lora.md):")
        print("  " + shlex.join(serve_command(facts, named_base, str(Path(out).resolve()), traits)))
        for note in notes:  # what the engine will not apply as training did (engines.caveats)
            print(f"warning: {note}", file=sys.stderr)
    return 0


def _check_engine(name: str, model, peft_cfg, layout: str):
    """(facts, traits, caveats) of the adapter on engine `name`; ValueError (one line, with the fix)
    when the engine would apply it differently from training. Before anything is written."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.peft.engines import adapter_traits, caveats, engine_facts, refusals

    facts = engine_facts(name)
    traits = adapter_traits(model, peft_cfg.rank, peft_cfg.alpha, peft_cfg.rslora)
    refused = refusals(facts, traits, layout)
    if refused:
        raise ValueError(f"--engine {name}: " + "; ".join(refused))
    return facts, traits, caveats(facts, traits)


def _export_model(ns: argparse.Namespace, cfg, run_dir: Path, manager, checkpoint) -> int:
    """The checkpoint's weights as the HF directory the run's own export writes (RUN_DIR/hf):
    in the dtype the run computed in, with its tokenizer, streamed (export_stream.py)."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.data.tokenizer import resolve_tokenizer_dir
    from glmtune.io.outputs import check_output
    from glmtune.io.sizes import parse_size
    from glmtune.models.registry import is_preset, model_args, model_spec
    from glmtune.train.model_source import tokenizer_dir_for
    from glmtune.train.precision import resolve_precision

    parse_size(ns.max_shard_size)  # a bad size is refused before anything is read
    model_dir = None if is_preset(cfg.model.name_or_path) else Path(cfg.model.name_or_path)
    tokenizer_dir = resolve_tokenizer_dir(tokenizer_dir_for(cfg, model_dir))
    # Everything this command reads; --hf may be none of them, --overwrite or not.
    sources = (("RUN_DIR", run_dir), ("checkpoint", checkpoint.path))
    if model_dir is not None:
        sources += (("the run's base", model_dir),)
    check_output(ns.hf, overwrite=ns.overwrite, sources=(*sources, ("the tokenizer", tokenizer_dir)), what="--hf")
    _check_intact(manager, checkpoint)
    precision = resolve_precision(cfg)
    spec = model_spec(cfg.model)
    model = spec.weights.build(model_args(cfg.model), precision.param_dtype, "meta", cfg.model)
    out = spec.weights.export_checkpoint(model, checkpoint.path, ns.hf, dtype=precision.compute_dtype,
                                 source_dir=tokenizer_dir, max_shard_size=ns.max_shard_size, overwrite=ns.overwrite,
                                 sources=sources, what="--hf", base_dir=model_dir)
    print(f"exported the model of {checkpoint.path} (step {checkpoint.step}) to {out}")
    _write_card(run_dir, Path(out), Path(out), "hf")
    return 0


def _write_card(run_dir: Path, out: Path, model_dir: Path, kind: str) -> None:
    """The export's model card, OUT/README.md, from the run's records (glmtune/release/model_card.py)."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.release.model_card import write_run_card

    print(f"wrote the model card {write_run_card(run_dir, out, model_dir, kind)}")
