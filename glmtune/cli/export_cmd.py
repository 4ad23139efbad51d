"""`glmtune export RUN_DIR --adapter OUT [--layout peft|per_expert]`: a LoRA run's adapter.

Rebuilds the run's model from RUN_DIR/config.yaml, applies its LoRA config, loads
the adapters from the newest complete checkpoint (or `--checkpoint step-N`), and
writes them in PEFT's format: `peft` (default) loads with
`peft.PeftModel.from_pretrained` on transformers' GlmMoeDsaForCausalLM;
`per_expert` is the layout vLLM and SGLang load (docs/lora.md).

The base weights play no part in an adapter, so the model is built on the meta
device and only the adapters (and buffers the checkpoint holds) are materialized:
exporting a GLM-5 run needs megabytes of memory, not the 1.5 TB base.
"""

from __future__ import annotations

import argparse
from pathlib import Path

_EXAMPLES = """examples:
  glmtune export runs/tiny-lora-support-json --adapter out/adapter
  glmtune export runs/tiny-lora-support-json --adapter out/adapter_vllm --layout per_expert
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.peft.adapter_export import LAYOUTS

    parser = subparsers.add_parser(
        "export",
        help="export a LoRA run's adapter (PEFT format)",
        description="Write the adapter of a finished or stopped LoRA run as adapter_config.json + "
                    "adapter_model.safetensors, from its newest checkpoint.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding config.yaml and checkpoints")
    parser.add_argument("--adapter", metavar="OUT", required=True, help="directory to write the adapter to")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and is not empty (never an input: RUN_DIR, the "
                             "checkpoint, or the run's base model)")
    parser.add_argument("--layout", choices=LAYOUTS, default="peft",
                        help="peft: PeftModel.from_pretrained on transformers (default); "
                             "per_expert: vLLM / SGLang per-expert keys")
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

    model = model_spec(cfg.model).build(model_args(cfg.model), getattr(torch, cfg.model.dtype), "meta")
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
    if config_sha256(spec_for(base_dir).args_from_hf(base_dir)) != recorded["config_sha256"]:
        raise ValueError(f"the base {base_dir} changed since the run trained on it (its config.json describes another "
                         "model); restore the base the run trained on, or the adapter will not fit it")


def _run(ns: argparse.Namespace) -> int:
    import torch

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.checkpoint.manager import CheckpointManager
    from glmtune.config import load_run_config
    from glmtune.io.outputs import check_output
    from glmtune.peft import export_adapter
    from glmtune.io.run_lock import read_run_record

    run_dir = Path(ns.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a glmtune run directory)")
    cfg = load_run_config(run_dir / "config.yaml")
    if cfg.peft.method != "lora":
        raise ValueError(f"{run_dir}: peft.method is {cfg.peft.method!r}; only LoRA runs have an adapter "
                         "(full fine-tuning exports with checkpoint.export_hf)")
    record = read_run_record(run_dir)  # None for runs from before run records
    run_id = record["run_id"] if record else None
    manager = CheckpointManager(checkpoint_root(cfg, run_dir), trainable_only=True, run_id=run_id)
    checkpoint = manager.resolve(ns.checkpoint) if ns.checkpoint else manager.latest()
    if checkpoint is None:
        raise FileNotFoundError(f"{manager.root}: no complete checkpoint of this run to export from")
    if run_id and checkpoint.run_id and checkpoint.run_id != run_id:
        raise ValueError(f"--checkpoint {checkpoint.path} was written by another run (run id {checkpoint.run_id}) "
                         f"than {run_dir} (run id {run_id}); export that checkpoint's own run directory")
    base_dir = run_base_dir(cfg, run_dir)
    # Everything this command reads; --adapter may be none of them, --overwrite or not.
    sources = (("RUN_DIR", run_dir), ("checkpoint", checkpoint.path), ("the run's base", base_dir))
    check_output(ns.adapter, overwrite=ns.overwrite, sources=sources, what="--adapter")
    base = record.get("base") if record else None
    _check_base_unchanged(base_dir, base)
    problems = manager.verify(checkpoint)
    if problems:
        raise ValueError(f"checkpoint {checkpoint.path} is damaged: {problems[0]}; choose another with --checkpoint")
    model = adapter_model(cfg)
    # The checkpoint holds optimizer state too; DCP needs an optimizer of the same shape.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    manager.load(checkpoint, model, optimizer)
    # The adapter names its base as training did: a preset's is the directory the run wrote.
    named_base = str(base_dir.resolve()) if base_dir == run_dir / "base" and base_dir.is_dir() \
        else cfg.model.name_or_path
    out = export_adapter(model, ns.adapter, ns.layout, named_base, overwrite=ns.overwrite, sources=sources,
                         base_identity=base)
    print(f"exported {ns.layout} adapter from {checkpoint.path} (step {checkpoint.step}) to {out}")
    return 0
