"""The scratch training runs: the reference run in this process, the others as fresh processes.

Every run is `glmtune train` itself (`glmtune.train.run.run_training`) on the scratch
configuration (OUT/work/config.yaml) with its own run directory, so the checks exercise
the trainer, checkpoint manager and exporters a real run uses.

The reference run (OUT/work/reference) trains `NUM_STEPS` steps in this process and
exports (HF for full fine-tuning, PEFT adapters for LoRA). Its hooks
(`glmtune.train.run.RunHooks`) record, without changing anything: a sample of every
trainable tensor before training (to tell which ones the first optimizer step moved: their fp32 masters where
the optimizer holds them), and
at each step the gradient of every trainable tensor once it is complete, before the
trainer checks, clips and applies it (norms per parameter group, and which tensors have
non-finite or no gradient). `on_model` lets a caller act on the built model (a test plants
a fault there through a real hook).

Fresh processes (`start`, `run`) are `python -m glmtune train` (under torchrun for
several), each with its output in `<run_dir>.log`. A one-process run gets as many CPU
threads as this process, so that its float sums run in the reference's order.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glmtune.distributed.launch import torchrun_command
from glmtune.io.json_file import json_lines
from glmtune.models.common.model_spec import ModelSpec
from glmtune.preflight.context import Preflight
from glmtune.train.master_adamw import MasterAdamW
from glmtune.train.run import RunHooks, run_training

_SAMPLE = 1 << 16  # elements sampled per tensor to tell whether a step changed it


def read_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the metrics.jsonl record of a run ({} when it logged none), read bounded
    (`glmtune.io.json_file.json_lines`; a line cut by a kill ends it); ValueError naming the
    file and line for a record without a step."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = {}
    for number, record, _ in json_lines(path, "metrics file", cut_tail=True):
        if type(record.get("step")) is not int:
            raise ValueError(f"metrics file {path}:{number}: a record without an integer step")
        records[record["step"]] = record
    return records


def clean_name(name: str) -> str:
    """A parameter's name without wrapper components (torch.compile's `_orig_mod`, FSDP's, AC's)."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # one process: a DTensor (FSDP2 on a one-rank group, for fp32 master weights) holds it all
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sample(tensor: torch.Tensor) -> torch.Tensor:
    """A strided sample of `tensor` (a view), copied to the host: cheap for any tensor size."""
    flat = _local(tensor).detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _SAMPLE)].float().cpu().clone()


@dataclass
class Gradients:
    """The gradients of one step, before the trainer checked, clipped and applied them."""

    norms: dict[str, float]  # group -> 2-norm over its trainable tensors (0.0 for a group with none)
    trainable: dict[str, int]  # group -> trainable elements
    total: dict[str, int]  # group -> elements, frozen ones included
    nonfinite: list[str]  # trainable tensors with a nan or inf gradient
    zero: list[str]  # trainable tensors with no gradient or an all-zero one

    @classmethod
    def of(cls, model: nn.Module, spec: ModelSpec) -> "Gradients":
        """The gradients `model` holds now, by `spec`'s parameter groups."""
        groups, param_group = spec.architecture.param_groups, spec.architecture.param_group
        everything = [(clean_name(n), p) for n, p in model.named_parameters()]
        named = [(n, p) for n, p in everything if p.requires_grad]
        with_grad = [(n, _local(p.grad)) for n, p in named if p.grad is not None]
        # fp64 on the CPU, fp32 on CUDA, as the trainer's norm (an fp64 norm copies bf16 gradients to fp64)
        dtype = torch.float64 if with_grad and with_grad[0][1].device.type == "cpu" else torch.float32
        norms = torch._foreach_norm([g for _, g in with_grad], 2.0, dtype=dtype) if with_grad else []
        squares, trainable, total = dict.fromkeys(groups, 0.0), dict.fromkeys(groups, 0), dict.fromkeys(groups, 0)
        nonfinite, zero = [], [n for n, p in named if p.grad is None]
        for (name, _), norm in zip(with_grad, (float(x) for x in norms)):
            squares[param_group(name)] += norm * norm
            if not math.isfinite(norm):
                nonfinite.append(name)
            elif norm == 0.0:
                zero.append(name)
        for name, param in everything:
            total[param_group(name)] += param.numel()
            trainable[param_group(name)] += param.numel() if param.requires_grad else 0
        return cls({g: math.sqrt(s) for g, s in squares.items()}, trainable, total, nonfinite, zero)


@dataclass
class ReferenceRun:
    run_dir: Path
    log: Path
    status: int | None = None  # run_training's exit status; None when it raised
    error: str | None = None
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    gradients: dict[int, Gradients] = field(default_factory=dict)
    moved: dict[str, bool] = field(default_factory=dict)  # trainable tensor -> changed by step 1
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 0 and bool(self.records)


def run_reference(pf: Preflight, on_model: Callable[[nn.Module], None] | None = None) -> ReferenceRun:
    """The scratch recipe's `NUM_STEPS` steps and export in this process (see module docstring)."""
    run_dir = pf.work / "reference"
    ref = ReferenceRun(run_dir, pf.work / "reference.log")
    cfg = pf.run_config(run_dir, "--checkpoint.export_hf", "true")
    before: dict[str, torch.Tensor] = {}

    def model_built(model: nn.Module) -> None:
        before.update({clean_name(n): sample(p) for n, p in model.named_parameters() if p.requires_grad})
        if on_model is not None:
            on_model(model)

    def gradients_complete(step: int, model: nn.Module) -> None:
        ref.gradients[step] = Gradients.of(model, pf.spec)

    def stepped(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step == 1:  # the first update is held by the fp32 master where there is one: a bf16 weight near 1
            # (a norm's) does not change at lr 1e-5 while its master moves (train.master_weights)
            masters = optimizer.master_of if isinstance(optimizer, MasterAdamW) else (lambda param: param)
            now = {clean_name(n): p for n, p in model.named_parameters()}
            ref.moved = {n: not torch.equal(was, sample(masters(now[n]))) for n, was in before.items()}

    start = time.perf_counter()
    with open(ref.log, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            ref.status = run_training(cfg, overwrite=True, hooks=RunHooks(model_built, gradients_complete, stepped))
        except Exception as exc:  # a check's failure, not preflight's: named in the report, traceback in the log
            ref.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=log)
    ref.seconds = time.perf_counter() - start
    ref.records = read_records(run_dir)
    return ref


def log_line(log: Path, marker: str) -> str | None:
    """The last line of `log` that holds `marker`."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if marker in line] \
        if log.is_file() else []
    return lines[-1] if lines else None


def train_command(pf: Preflight, run_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    pf.scratch()  # OUT/work/config.yaml, written on first use
    args = pf.train_args(run_dir, *extra)
    return torchrun_command(nproc, args) if nproc > 1 else [sys.executable, "-m", "glmtune", "train", *args]


def start(pf: Preflight, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A fresh `glmtune train` process of the scratch recipe in `run_dir`, and its log."""
    command, log = train_command(pf, run_dir, *extra), run_dir.with_name(run_dir.name + ".log")
    with open(log, "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env=pf.env())
    return proc, log


def run(pf: Preflight, run_dir: Path, *extra: str, nproc: int = 1, timeout: float = 3600) -> tuple[int, Path]:
    """Run the scratch recipe in `run_dir` in fresh processes (torchrun for several): (status, log)."""
    command, log = train_command(pf, run_dir, *extra, nproc=nproc), run_dir.with_name(run_dir.name + ".log")
    with open(log, "a") as out:
        done = subprocess.run(command, stdout=out,
                              stderr=subprocess.STDOUT, env=pf.env(nproc), timeout=timeout)
    return done.returncode, log
