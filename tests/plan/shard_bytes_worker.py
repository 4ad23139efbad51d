"""One rank of a short `glmtune train` run that records what this rank holds after its first
optimizer step: the local bytes of its parameters, gradients and AdamW state (moments and fp32
masters; DTensor local shards), as `<out>/rank-<r>.json`. Run by tests/plan/test_model_state.py under torchrun:

    python -m torch.distributed.run --nproc-per-node N tests/plan/shard_bytes_worker.py OUT RECIPE [overrides]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def main() -> int:
    from glmtune.config import load_config
    from glmtune.train.run import RunHooks, run_training

    out, recipe, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rank = int(os.environ.get("RANK", "0"))

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
        (out / f"rank-{rank}.json").write_text(json.dumps({"params": params, "grads": grads, "optimizer": moments}))

    return run_training(load_config(recipe, overrides), hooks=RunHooks(on_optimizer_step=record))


if __name__ == "__main__":
    sys.exit(main())
