"""One rank of a short `glmtune train` run that records what this rank holds after its first
optimizer step: the local bytes of its parameters, gradients and AdamW state (moments and fp32
masters; DTensor local shards), as `<out>/rank-<r>.json`. tests/plan/test_model_state.py runs
`record_one_rank` on N ranks forked from the gloo fork server (tests/distributed/gloo_helpers.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from glmtune.config import load_config
from glmtune.train.run import RunHooks, run_training


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def record_one_rank(rank: int, world_size: int, out: str, recipe: str, overrides: list[str]) -> None:
    """The run on this rank of the joined gloo group (as torchrun describes it to the run), its bytes
    after the first optimizer step into `<out>/rank-<rank>.json`."""
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))

    def record(step, model, optimizer):
        if step != 1:
            return
        params = grads = moments = 0
        for param in model.parameters():
            local = _local(param)
            params += local.numel() * local.element_size()
            if param.grad is not None:
                grad = _local(param.grad)
                grads += grad.numel() * grad.element_size()
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                moment = _local(state[key])
                moments += moment.numel() * moment.element_size()
        for master in getattr(optimizer, "masters", {}).values():  # fp32 masters held by the optimizer
            moments += _local(master).numel() * 4
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps({"params": params, "grads": grads,
                                                                  "optimizer": moments}))

    assert run_training(load_config(recipe, overrides), hooks=RunHooks(on_optimizer_step=record)) == 0
