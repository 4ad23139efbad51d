"""The plan's gradient accumulators under a pipeline: FSDP2 keeps each unit's unsharded gradient, upcast
to fp32, from a stage's first microbatch's backward to its last's (torch's pipeline stages reduce once,
after the last), so a rank holds the accumulators of every stage part-way through its microbatches
(glmtune/plan/memory.py `_accumulating`, glmtune/distributed/schedule_order.py `backward_states`)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from glmtune.config import load_config
from glmtune.plan.measure import planned_for
from glmtune.plan.model_state import build_meta_model, layer_stages, rank_state, stage_of_unit
from glmtune.plan.planner import degrees_for
from tests.distributed.gloo_helpers import run_gloo

DUALPIPEV = ["--parallel.pp_schedule", "DualPipeV", "--parallel.pp_stages_per_rank", "2",
             "--train.micro_batch_size", "16", "--train.global_batch_size", "1024", "--parallel.pp_microbatches", "16"]
ACCUMULATED = " gradients accumulated over the microbatches (fp32)"


def _fsdp_keeps_fp32_unsharded_gradients(rank: int, world_size: int, out: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 6, bias=False, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,))
    # parallelize_glm5's policy: parameters stay in their dtype (bf16), gradients reduce in fp32
    fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32),
                reshard_after_forward=False)
    layer.set_requires_gradient_sync(False)  # what a pipeline stage sets for every microbatch's backward
    kept = []
    for _ in range(2):
        layer(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
        (fsdp_param,) = layer._get_fsdp_state()._fsdp_param_group.fsdp_params
        grad = fsdp_param.unsharded_accumulated_grad
        kept.append(None if grad is None else [str(grad.dtype), list(grad.shape)])
    sharded = layer.weight.grad
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"kept": kept, "sharded_grad": sharded is not None}, f)
    dist.barrier()


def test_fsdp2_keeps_an_fp32_unsharded_gradient_between_microbatches_that_do_not_reduce(tmp_path):
    out = tmp_path / "kept.json"
    run_gloo(_fsdp_keeps_fp32_unsharded_gradients, 2, tmp_path, str(out))
    seen = json.loads(out.read_text())
    # the whole weight (6 x 8, not a rank's 3 x 8) in fp32 after each backward; no sharded gradient yet
    assert seen == {"kept": [["torch.float32", [6, 8]]] * 2, "sharded_grad": False}


def _accumulator_bytes(cfg, rank: int) -> dict[int, int]:
    """Each of the rank's stages' trainable parameters, unsharded, in fp32: from the model state."""
    degrees = degrees_for(cfg)
    model = build_meta_model(cfg)
    stage, stages_of_rank = layer_stages(model, cfg, degrees)
    final = max(max(s) for s in stages_of_rank)
    per_stage: dict[int, int] = {}
    for name, unit in rank_state(model, cfg, degrees, rank).units.items():
        if name.startswith("layer.") or name in ("embed", "head", "mtp.0"):
            s = stage_of_unit(name, stage, final)
            per_stage[s] = per_stage.get(s, 0) + unit.trainable_gathered * 4
    return per_stage


def test_dualpipev_holds_both_stages_accumulators_at_its_peak():
    cfg = load_config("recipes/glm5/sft_4k.yaml", DUALPIPEV)
    plan = planned_for(cfg, degrees_for(cfg), 0)
    expected = _accumulator_bytes(cfg, 0)
    assert sorted(expected) == [0, 7]  # the V: rank 0 runs the first stage and the last
    held = {k: v for k, v in plan.peak.parts.items() if k.endswith(ACCUMULATED)}
    assert held == {f"stage {s}{ACCUMULATED}": expected[s] for s in (0, 7)}
    # the embedding's, the head's and the MTP layer's are among them, beside 18 layers' (~33 GiB)
    assert 30 * 2**30 < sum(held.values()) < 36 * 2**30
    # 95.4 GiB: the 68.4 planned before them fit the H100 it ran out of memory on (docs/plan.md)
    assert 80 * 2**30 < plan.peak.total


def test_the_interleaved_recipe_peaks_at_its_first_stages_last_backward():
    """sft_4k (Interleaved1F1B, 9 stages per rank, 4 microbatches): rank 0's peak is its first stage's
    backward, the other stages reduced, with that stage's accumulators: its embedding's and three layers'.
    Measured on an H100 (2026-12-07, `benchmarks/rank_memory_snapshot.py --rank 0 --at-peak`, docs/plan.md):
    7.92 GiB from FSDP2's `to_accumulated_grad_if_needed` at the rank's 62.55 GiB peak."""
    cfg = load_config("recipes/glm5/sft_4k.yaml")
    plan = planned_for(cfg, degrees_for(cfg), 0)
    held = {k: v for k, v in plan.peak.parts.items() if k.endswith(ACCUMULATED)}
    assert held == {f"stage 0{ACCUMULATED}": _accumulator_bytes(cfg, 0)[0]}
    assert abs(held[f"stage 0{ACCUMULATED}"] / 2**30 - 7.92) < 0.02 * 7.92
