"""One real gloo rank running what `glmtune plan --measure` runs (`measure_in_world`: the same
model share, random weights, rows and trainer) for one step, recording as `<out>/rank-<r>.json`
its parameter/gradient/AdamW bytes, the first step's per-micro-batch losses, and the bytes the
outputs of its all-gathers and reduce-scatters received. tests/plan/test_measure.py runs
`measure_one_rank` on N ranks forked from the gloo fork server (tests/distributed/gloo_helpers.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from glmtune.config import load_config
from glmtune.plan.measure import measure_in_world
from glmtune.plan.planner import degrees_for

# name -> which argument receives (the output)
_COUNTED = {"all_gather_into_tensor": 0, "all_gather_single": 0, "all_gather": 0, "reduce_scatter_tensor": 0,
            "reduce_scatter_single": 0}
_KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "all_gather": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


def count_collectives(counts: dict[str, int]) -> None:
    """Wrap torch.distributed's all-gathers and reduce-scatters (both namespaces: FSDP2 calls
    `dist.X`, all_gather_object calls c10d's own) to add up their outputs' bytes, outermost call only."""
    depth = [0]
    for name in _COUNTED:
        original = getattr(c10d, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def counted(*args, _original=original, _name=name, **kwargs):
            output = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list", kwargs.get("output")))
            if depth[0] == 0:
                tensors = output if isinstance(output, list) else [output]
                counts[_KIND[_name]] = counts.get(_KIND[_name], 0) + sum(t.numel() * t.element_size() for t in tensors)
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(c10d, name, counted)
        if hasattr(dist, name):
            setattr(dist, name, counted)


def measure_one_rank(rank: int, world_size: int, out: str, recipe: str, overrides: list[str]) -> None:
    """`measure_in_world` on this rank of the joined gloo group, its figures into `<out>/rank-<rank>.json`."""
    counts: dict[str, int] = {}
    count_collectives(counts)
    cfg = load_config(recipe, overrides)
    measured = measure_in_world(cfg, degrees_for(cfg, world_size), steps=1, warmup=0)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(
        {"held": measured.held, "first_micro_losses": measured.first_micro_losses, "collectives": counts}))
