"""What a resume takes from its checkpoint, what it takes from the config, and the checks between.

A checkpoint holds where the run was: the step, the data position (`loader.epoch`, `loader.cursor`),
the scheduler's step count, the optimizer's moments. Those are taken as saved, after checking that
they agree with the step and with each other: the scheduler at `last_epoch == step`, the loader's
position (micro-batches drawn, at least one a step; the batch size may have changed on an earlier
resume) within its epoch and matching the tokens counted (`tokens_seen`: each micro-batch's rows,
between the shortest and the longest row's length each). A state whose numbers were edited into
range, say `loader.epoch 10**6`, would otherwise silently train on other batches.

A checkpoint also holds the optimizer's hyperparameters (each group's lr, betas, weight decay, eps)
and the scheduler's base learning rates, which loading it would put back over the config's. A
resume may change settings (the run says which), and a setting the config accepts takes effect:
so after loading, every group's hyperparameters are the configured ones again, the base learning
rates the configured `optim.lr`, and the current learning rate the configured schedule's at the
step reached. A resume with the same settings gets exactly the saved values back (the same
arithmetic on the same numbers); a resume with `--optim.lr` halved after a loss spike trains at
half the rate from its first step, as the run's "resuming with changed settings" line says.

That line compares resolved values: a setting left null stands for what it resolves to
(`null_settings`), so a run saved before `peft.target_modules: null` meant the family's default
(its config.yaml holds GLM-5's list) resumed with the recipe's null is no change when the family's
default for its model is that list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glmtune.config import JobConfig
from glmtune.models.registry import model_spec
from glmtune.peft import target_globs
from glmtune.train.data_loader import PackedRowLoader


@dataclass(frozen=True)
class Configured:
    """The optimizer's and the scheduler's settings as the config made them (before a checkpoint loads)."""

    groups: list[dict[str, Any]]  # each param group's hyperparameters, without its parameters
    base_lrs: list[float]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> Configured:
        groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        return cls(groups, list(scheduler.base_lrs))


def check_position(state: dict[str, Any], where: str, loader: PackedRowLoader) -> None:
    """The checkpoint's data position, token count and scheduler count agree with its step and with
    each other (module docstring); ValueError naming the file `where` and the fields otherwise."""
    step, saved = state["step"], state["loader"]
    now = loader.state_dict()
    if any(saved[key] != value for key, value in now.items() if key not in ("epoch", "cursor")):
        return  # other data or batch layout: the loader refuses it by name (PackedRowLoader.load_state_dict)
    epoch, cursor, tokens = saved["epoch"], saved["cursor"], state["tokens_seen"]
    per_epoch, rows_per_batch = loader.batches_per_epoch, loader.micro_batch_size * loader.world_size
    position = epoch * per_epoch + cursor  # micro-batches drawn
    shortest, longest = min(map(_length, loader.rows)), max(map(_length, loader.rows))
    # The loader moves to the next epoch lazily: a finished epoch leaves cursor == per_epoch, never 0.
    # Every step draws at least one micro-batch, and every micro-batch counts its rows' tokens.
    if not (cursor <= per_epoch and cursor > 0 and position >= step
            and position * rows_per_batch * shortest <= tokens <= position * rows_per_batch * longest):
        raise ValueError(f"{where}: loader.epoch {epoch}, loader.cursor {cursor} and tokens_seen {tokens:,} are not "
                         f"what {step} steps leave ({per_epoch} micro-batches of {rows_per_batch} rows an epoch, "
                         f"rows of {_span(shortest, longest)} tokens); the trainer state was not written by glmtune")
    scheduler = state["scheduler"]
    if scheduler.get("last_epoch") != step or scheduler.get("_step_count") != step + 1:
        raise ValueError(f"{where}: scheduler.last_epoch {scheduler.get('last_epoch')} and scheduler._step_count "
                         f"{scheduler.get('_step_count')} are not what {step} steps leave ({step} and {step + 1}); "
                         "the trainer state was not written by glmtune")


def _span(low: int, high: int) -> str:
    return f"{low}" if low == high else f"{low} to {high}"


def _length(row: dict[str, Any]) -> int:
    return len(row["input_ids"])


def apply_configured(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                     configured: Configured, step: int) -> None:
    """Put the configured hyperparameters back over the loaded ones, and the configured schedule's
    learning rate at `step` (module docstring)."""
    assert len(optimizer.param_groups) == len(configured.groups), "check_param_groups compares the groups"
    scheduler.base_lrs = list(configured.base_lrs)
    for group, settings, base_lr, factor in zip(optimizer.param_groups, configured.groups, configured.base_lrs,
                                                 scheduler.lr_lambdas):
        group.update({key: value for key, value in settings.items() if key != "lr"})
        group["lr"] = base_lr * factor(step)  # what LambdaLR.step() sets after `step` steps
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def null_settings(cfg: JobConfig) -> dict[str, Callable[[], Any]]:
    """Dotted key -> what its null stands for in `cfg` (asked only when a saved and a resolved config
    differ by that null: run_dir.config_changes). `peft.target_modules`: the family's default targets
    for the model, read from the model built on the meta device (nothing read but its config)."""
    def default_targets() -> list[str]:
        model, _ = model_spec(cfg.model).weights.build_from_config(cfg.model, torch.float32, "meta", cfg.train.seed)
        return target_globs(model, cfg.peft)

    return {"peft.target_modules": default_targets}
