"""HSDP: `parallel.dp_replicate 2` x `dp_shard 2` over 4 processes (gloo, CPU, fp32) gives the
per-step losses and gradient norms of the single-process run with the same global batch.

The gradient norms pin the arithmetic: each rank's loss is divided by the global count of
supervised tokens, so the step's gradient is the plain sum over ranks; FSDP2's default
averaging (over the shard group, then the replicas) would scale it by 1/4."""

from __future__ import annotations

import json

import pytest
from glmtune.checkpoint.dcp_storage import JsonMetadataReader

from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.forked_runs import train_in_forks
from tests.train.run_helpers import WITH_EXPORT, shared_run

# Global batch 4: one row per rank and step here; in one process two accumulated micro-batches of
# 2 rows (the shared reference of tests/distributed/test_expert_parallel_train.py; its HF export is not read).
BATCH = ["--train.max_steps", "4", "--train.global_batch_size", "4", "--train.micro_batch_size", "1"]


def _records(run_dir) -> dict[int, tuple[float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines)}


def test_hsdp_2x2_matches_single_process_losses_and_grad_norms(tmp_path, shared_results):
    single = shared_run(shared_results, *WITH_EXPORT)
    cache = single.cache_dir
    train_in_forks({tmp_path / "hsdp": [*BATCH, "--parallel.dp_replicate", "2"]}, cache, nproc=4)
    assert "world 4 = dp_replicate 2 x dp_shard 2" in " ".join((tmp_path / "hsdp.out").read_text().split())

    expected, actual = _records(single.run_dir), _records(tmp_path / "hsdp")
    assert sorted(actual) == [1, 2, 3, 4]
    for step, (loss, grad_norm) in expected.items():  # only the order of the fp32 sums differs
        assert actual[step][0] == pytest.approx(loss, rel=1e-5), step
        assert actual[step][1] == pytest.approx(grad_norm, rel=1e-5), step
    # The mesh is 2 x 2, not 4: each parameter is saved as the 2 shards of one replica.
    metadata = JsonMetadataReader(tmp_path / "hsdp" / "checkpoints" / "step-00000004").read_metadata()
    names = {f"model.{name}" for name, _ in build_model(get_preset("tiny")).named_parameters()}
    assert {len(metadata.state_dict_metadata[name].chunks) for name in names} == {2}
