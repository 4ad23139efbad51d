"""The models later checks compare: the base a scratch run started from, and what it trained.

`base_model` builds the scratch recipe's model as training builds it
(`build_model_from_config`: a preset from its seed, an HF directory's real weights), with no
adapter. `trained_model` adds what a scratch run saved: the same model, LoRA applied as
training applies it, then its newest checkpoint loaded by `CheckpointManager.load` (verified
against its checksums first, resharded by DCP from whatever layout saved it; the optimizer
state is read into an AdamW of the run's shape, as resuming does).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from glmtune.checkpoint.manager import Checkpoint, CheckpointManager
from glmtune.peft import apply_lora
from glmtune.preflight.context import Preflight
from glmtune.train.optim import build_optimizer
from glmtune.train.model_source import build_model_from_config
from glmtune.train.precision import resolve_precision


def base_model(pf: Preflight, device: torch.device | None = None) -> nn.Module:
    model, _ = build_model_from_config(pf.scratch(), device or pf.device)
    return model.eval()


def trained_model(pf: Preflight, run_dir: Path, device: torch.device | None = None) -> tuple[nn.Module, Checkpoint]:
    """The scratch model with the newest checkpoint of the run in `run_dir`.

    Raises:
        FileNotFoundError: the run saved no checkpoint.
        ValueError: the checkpoint is damaged (named).
    """
    cfg = pf.scratch()
    model = base_model(pf, device)
    # as training does: the MTP layer and the indexers train with their losses (under LoRA: the MTP layer's adapters)
    pf.spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    if pf.lora:
        apply_lora(model, cfg.peft, seed=cfg.train.seed)
    manager = CheckpointManager(run_dir / "checkpoints", trainable_only=pf.lora)
    checkpoint = manager.latest()
    if checkpoint is None:
        raise FileNotFoundError(f"{manager.root}: no complete checkpoint")
    problems = manager.verify(checkpoint)
    if problems:
        raise ValueError(f"checkpoint {checkpoint.path} is damaged: {problems[0]}")
    o = cfg.optim
    optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.fused,
                                masters=resolve_precision(cfg).masters)
    manager.load(checkpoint, model, optimizer)
    return model.eval(), checkpoint
