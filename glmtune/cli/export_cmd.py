"""`glmtune export RUN_DIR --adapter OUT [--layout peft|per_expert]`: a LoRA run's adapter.

Rebuilds the run's model from RUN_DIR/config.yaml, applies its LoRA config, loads
the adapters from the newest complete checkpoint (or `--checkpoint step-N`), and
writes them in PEFT's format: `peft` (default) loads with
`peft.PeftModel.from_pretrained` on transformers' GlmMoeDsaForCausalLM;
`per_expert` is the layout vLLM and SGLang load (docs/lora.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

_EXAMPLES = """examples:
  glmtune export runs/tiny-lora-support-json --adapter out/adapter
  glmtune export runs/tiny-lora-support-json --adapter out/adapter_vllm --layout per_expert
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from glmtune.peft.export import LAYOUTS

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
    parser.add_argument("--layout", choices=LAYOUTS, default="peft",
                        help="peft: PeftModel.from_pretrained on transformers (default); "
                             "per_expert: vLLM / SGLang per-expert keys")
    parser.add_argument("--checkpoint", metavar="STEP_DIR", default=None,
                        help="a step-N checkpoint directory (default: the newest complete one)")
    parser.set_defaults(func=_run)


def checkpoint_root(cfg, run_dir: Path) -> Path:
    """Where the run's checkpoints are: checkpoint.dir as recorded, else RUN_DIR/checkpoints.

    The recorded path is relative to wherever training ran; a run directory that was
    moved or copied still has its checkpoints under RUN_DIR.
    """
    recorded = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    if recorded is not None and recorded.is_dir():
        return recorded
    return run_dir / "checkpoints"


def _run(ns: argparse.Namespace) -> int:
    import torch

    from glmtune.checkpoint.manager import CheckpointManager
    from glmtune.config import load_config
    from glmtune.peft import apply_lora, export_adapter
    from glmtune.train.recipe import build_model_from_config

    run_dir = Path(ns.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a glmtune run directory)")
    cfg = load_config(run_dir / "config.yaml")
    if cfg.peft.method != "lora":
        raise ValueError(f"{run_dir}: peft.method is {cfg.peft.method!r}; only LoRA runs have an adapter "
                         "(full fine-tuning exports with checkpoint.export_hf)")
    manager = CheckpointManager(checkpoint_root(cfg, run_dir), trainable_only=True)
    checkpoint = manager.resolve(ns.checkpoint) if ns.checkpoint else manager.latest()
    if checkpoint is None:
        raise FileNotFoundError(f"{manager.root}: no complete checkpoint to export from")
    model, model_dir = build_model_from_config(cfg, "cpu")
    apply_lora(model, cfg.peft)
    # The checkpoint holds optimizer state too; DCP needs an optimizer of the same shape.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    manager.load(checkpoint, model, optimizer)
    out = export_adapter(model, ns.adapter, ns.layout, str(model_dir) if model_dir else cfg.model.name_or_path)
    print(f"exported {ns.layout} adapter from {checkpoint.path} (step {checkpoint.step}) to {out}")
    return 0
