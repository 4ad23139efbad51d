"""A forward outside training (generation, validation) must not change the training that
follows under FSDP2: its gathered root weights are released (glmtune/distributed/fsdp_state.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.train.generate import greedy_generate
from tests.distributed.gloo_helpers import run_gloo


def _train(rank: int, world_size: int, out: str) -> None:
    from glmtune.config.schema import ParallelConfig
    from glmtune.distributed.mesh import ParallelMesh
    from glmtune.models.glm5.parallelize import parallelize_glm5

    results = {}
    for generate_first in (False, True):
        model = build_model(get_preset("tiny"), torch.float32, "cpu", "eager", seed=0)
        parallelize_glm5(model, mesh=ParallelMesh.from_config(ParallelConfig(), world_size=world_size))
        if generate_first:  # what the "before" samples do: hidden-state forwards, then the head
            greedy_generate(model, [5, 6, 7, 8], max_new_tokens=3, stop_ids=set())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(3):
            ids = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(ids, MicroBatch(ids, targets=torch.roll(ids, -1, 1)), compute_logits=False).loss_sum
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[str(generate_first)] = losses
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_generation_before_training_changes_nothing_under_fsdp2(tmp_path):
    run_gloo(_train, 2, tmp_path, str(tmp_path), timeout_s=240)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["True"] == results["False"], results  # bit for bit, every step
