"""Check 10: a short multi-process run of the recipe's layout scaled down to this machine.

The scratch recipe runs under torchrun (gloo on CPUs, NCCL on GPUs) with `Preflight.nproc`
processes (the GPUs of this host; 2 on a CPU machine) and the recipe's parallel layout
scaled down to them (`layout.scaled_replica`: each axis the recipe uses at 2, FSDP over the
rest). The layout is validated for that world first (`check_launch`, what
`glmtune train --nproc-per-node` runs). It trains the reference run's steps on the same
global batch, so each step's loss and gradient norm must equal the one-process reference
run's: relative 1e-5 on CPU in float32 (sums over ranks run in another order), 1e-3 in
bfloat16 or on GPUs.

The checkpoint layout: the run's last checkpoint, written sharded by every rank, is loaded
(resharded by DCP) into one process's model, and so is the reference run's, one after the
other. Both must give the same loss on the first training row, within the same tolerance;
their largest parameter difference over a strided sample of every tensor is recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from glmtune.distributed.launch import check_launch
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import model_dims
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, skipped, verdict
from glmtune.preflight.resume import compare_steps, same
from glmtune.preflight.runs import ReferenceRun, log_line, read_records, run, sample
from glmtune.preflight.trained import trained_model
from glmtune.train.data_loader import collate


def tolerance(pf: Preflight) -> tuple[float, str]:
    if pf.device.type == "cpu" and pf.cfg.model.dtype == "float32":
        return 1e-5, "relative 1e-5: CPU, float32, sums over ranks in another order"
    return 1e-3, f"relative 1e-3: {pf.device.type}, {pf.cfg.model.dtype}"


@torch.no_grad()
def row_loss(spec: ModelSpec, model: torch.nn.Module, row: dict, device: torch.device) -> float:
    loss_sum, count, _ = spec.compute.step_runner(model).evaluate(MicroBatch.of_batch(collate([row])))
    return (loss_sum / count).item()


def checkpoint_probe(pf: Preflight, run_dir) -> tuple[float, dict[str, torch.Tensor], object]:
    """A run's last checkpoint loaded in one process: its loss on the first training row, a sample of
    every tensor, the checkpoint. One model at a time: nothing of it stays on the device."""
    model, checkpoint = trained_model(pf, run_dir)
    loss = row_loss(pf.spec, model, pf.data().train_rows[0], pf.device)
    return loss, {name: sample(p) for name, p in model.named_parameters()}, checkpoint


def check_multiprocess(pf: Preflight, ref: ReferenceRun, *extra: str) -> CheckResult:
    """Check 10; `extra` overrides reach the multi-process run only (a test plants a difference there)."""
    replica = pf.replica
    if replica.world < 2:
        return skipped(10, f"{pf.nproc} process available here ({pf.device.type}); a multi-process run needs 2 "
                           "(give --nproc, or run on a host with more GPUs)")
    run_dir = pf.work / "multiprocess"
    layout = [*replica.layout, *extra]
    evidence: dict[str, Any] = {"run_dir": str(run_dir), "layout": replica.describe(), "overrides": layout,
                                "not_exercised": replica.not_exercised}
    try:
        cfg = pf.run_config(run_dir, *layout)
        check_launch(cfg, replica.world, model_dims(cfg.model))
    except ValueError as exc:
        return CheckResult(10, "fail", f"the scaled layout does not validate: {exc}", evidence)
    status, log = run(pf, run_dir, *layout, nproc=replica.world)
    evidence["log"] = str(log)
    if status != 0:
        why = log_line(log, "error") or f"torchrun exit status {status}"
        return CheckResult(10, "fail", f"the {replica.describe()} run failed: {why}", evidence)
    rel, how = tolerance(pf)
    evidence["tolerance"] = how
    problems, evidence["steps"] = compare_steps(read_records(run_dir), ref.records, sorted(ref.records), rel,
                                                replica.describe())
    (loss, samples, saved), (reference_loss, reference_samples, reference) = (
        checkpoint_probe(pf, run_dir), checkpoint_probe(pf, ref.run_dir))
    difference = max((samples[n] - reference_samples[n]).abs().max().item() for n in samples)
    evidence["checkpoint"] = {"multi_process": str(saved.path), "reference": str(reference.path),
                              "files": sorted(f.name for f in saved.path.iterdir()),
                              "loss_on_first_row": loss, "reference_loss_on_first_row": reference_loss,
                              "max_parameter_difference": difference,
                              "parameter_difference_over": "a strided sample of every tensor (runs.sample)"}
    if not same(loss, reference_loss, rel):
        problems.append(f"the {replica.world}-process checkpoint, loaded in one process, gives loss {loss!r} on "
                        f"the first row; the reference's gives {reference_loss!r}")
    missing = f"; not exercised: {'; '.join(replica.not_exercised)}" if replica.not_exercised else ""
    message = (f"{replica.describe()}: {len(evidence['steps'])} step losses and gradient norms equal the "
               f"one-process run ({how}); its sharded checkpoint loads in one process with the reference's loss "
               f"(max parameter difference {difference:.2g}){missing}")
    return verdict(10, problems, message, evidence)
