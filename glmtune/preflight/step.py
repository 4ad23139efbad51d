"""Checks 5 and 6: one training step on the recipe's data, and its gradients path by path.

Both read the reference run (`runs.run_reference`): `glmtune train` on the scratch recipe,
in this process, the rows read, checked, tokenized and packed by the recipe's pipeline.

Check 5 passes when the run's first step completed (forward, backward, optimizer step,
scheduler) with a finite loss over a positive number of supervised tokens, and every
trainable tensor with a non-zero gradient was moved by the optimizer step (a sample of each
tensor, taken before training, compared after the step).

Check 6 passes when, at the first step, every parameter group that trains has a finite,
non-zero gradient norm: attention, indexer, router, shared experts, routed experts, dense
MLP, and the norms, embeddings, head and MTP layers where they train. A frozen group has no
gradient and says so (the indexer and MTP layers by design). Every trainable tensor must
have a finite gradient at every step, and a non-zero one at the second step (a LoRA A
factor has none at the first: B starts at zero). Each failure names the path and tensors.
"""

from __future__ import annotations

import math
from typing import Any

from glmtune.io.json_file import read_json_file
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, skipped, verdict
from glmtune.preflight.runs import ReferenceRun, log_line
from glmtune.preflight.trainable import FROZEN_BY_DESIGN


# The paths the guide names (attention, indexer, router, shared and routed experts, dense MLP): GLM-5's
# parameter groups; another family's groups are reported as they are.
GUIDE_PATHS = ("attention", "indexer", "router", "shared_experts", "routed_experts", "dense_mlp")


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def run_evidence(pf: Preflight, ref: ReferenceRun) -> dict[str, Any]:
    manifest = ref.run_dir / "data_manifest.json"
    return {"run_dir": str(ref.run_dir), "log": str(ref.log), "seconds": round(ref.seconds, 2),
            "model": pf.describe_model(), "device": str(pf.device), "dtype": pf.cfg.model.dtype,
            "scratch_config": str(pf.scratch_yaml), "differs_from_the_recipe": pf.notes,
            "data": read_json_file(manifest, "data manifest") if manifest.is_file() else None}


def check_step(pf: Preflight, ref: ReferenceRun) -> CheckResult:
    evidence = run_evidence(pf, ref)
    if ref.error is not None:
        return CheckResult(5, "fail", f"the training step did not run: {ref.error}", evidence)
    first = ref.records.get(1)
    evidence["step_1"] = first
    if ref.status != 0 or first is None:
        stopped = log_line(ref.log, "stopped:") or log_line(ref.log, "error") or f"exit status {ref.status}"
        return CheckResult(5, "fail", f"the training step did not complete: {stopped}", evidence)
    problems = []
    if not math.isfinite(first["loss"]):
        problems.append(f"loss is {first['loss']} at step 1")
    if first["supervised_tokens"] <= 0:
        problems.append("no supervised token in the first step's rows")
    expected = [n for n, moved in ref.moved.items() if n not in ref.gradients[1].zero]
    stuck = [n for n in expected if not ref.moved[n]]
    if stuck:
        problems.append(f"the optimizer step left {len(stuck)} trainable tensors with gradients unchanged: "
                        f"{_names(stuck)}")
    evidence["updated_tensors"] = {"moved": sum(ref.moved.values()), "trainable": len(ref.moved),
                                   "with_gradient": len(expected)}
    data = evidence["data"] or {}
    packing = data.get("train_packing")
    rows = packing.get("num_rows") if isinstance(packing, dict) else None
    message = (f"loss {first['loss']:.4f} over {first['tokens']:,} tokens ({first['supervised_tokens']:,} supervised) "
               f"in {pf.replica.batch[-1]} of the data's {rows} packed rows ({data.get('train_conversations')} "
               f"conversations); lr {first['lr']:.3g}, "
               f"grad norm {first['grad_norm']:.4g}; the step moved {len(expected) - len(stuck)} of {len(expected)} "
               f"tensors with gradients; {pf.describe_model()}, {pf.device.type} {pf.cfg.model.dtype}")
    return verdict(5, problems, message, evidence)


def check_gradients(pf: Preflight, ref: ReferenceRun) -> CheckResult:
    if 1 not in ref.gradients:
        return skipped(6, "no gradient was computed: the training step did not run (check 5)")
    first, last_step = ref.gradients[1], max(ref.gradients)
    problems, paths = [], {}
    for group in pf.spec.architecture.param_groups:
        trainable, norm = first.trainable[group], first.norms[group]
        bad = [n for n in first.nonfinite if pf.spec.architecture.param_group(n) == group]
        if not first.total[group]:
            state = "not in the model"
        elif not trainable:
            state = f"frozen ({FROZEN_BY_DESIGN.get(group, 'by the recipe')}): no gradient"
        elif not math.isfinite(norm):
            state = "non-finite"
            problems.append(f"{group}: gradient norm {norm} at step 1 ({_names(bad)})")
        elif norm == 0.0:
            state = "zero"
            problems.append(f"{group}: gradient norm 0 at step 1 on a trainable path ({trainable:,} parameters)")
        else:
            state = "finite, non-zero"
        paths[group] = {"trainable": trainable, "total": first.total[group], "state": state,
                        **{f"norm_step_{s}": g.norms[group] for s, g in sorted(ref.gradients.items())}}
    for step, grads in sorted(ref.gradients.items()):
        if grads.nonfinite and step > 1:
            problems.append(f"step {step}: non-finite gradients in {_names(grads.nonfinite)}")
    if last_step > 1 and ref.gradients[last_step].zero:
        problems.append(f"step {last_step}: no gradient reaches trainable {_names(ref.gradients[last_step].zero)}")
    evidence = {"paths": paths, "zero_at_step_1": first.zero, "steps": sorted(ref.gradients),
                "note": "norms before clipping; a LoRA A factor has a zero gradient at step 1 (B starts at zero)"}
    guide = [g for g in GUIDE_PATHS if g in paths]  # the guide's paths among the family's groups
    shown = [f"{g} {p['norm_step_1']:.3g}" if p["trainable"] else f"{g} frozen"
             for g, p in paths.items() if p["total"] and (p["trainable"] or g in guide)]
    absent = [g for g in guide if not paths[g]["total"]]
    message = "norms at step 1: " + ", ".join(shown)
    if absent:
        message += f"; not in {pf.describe_model()}, so not exercised: {', '.join(absent)}"
    if last_step > 1:
        message += f"; every trainable tensor has a finite, non-zero gradient at step {last_step}"
    return verdict(6, problems, message, evidence)
