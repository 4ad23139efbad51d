"""NVIDIA's GLM-5.x topologies, scaled down: each GLM recipe's own settings (schedule, activation
checkpointing, router-bias update, asynchronous checkpoints, LoRA) at degrees of 2 on the tiny
model, under torchrun (gloo, CPU), equal one process step by step (fp32, relative 1e-5).

    recipes/glm5*/sft_4k.yaml       pp 4 x dp_shard 64, ep 64, Interleaved1F1B  -> pp 2 x dp_shard 2, ep 2
    recipes/glm5*/sft_32k_cp8.yaml  pp 4 x dp_shard 16 x cp 8, ep 64            -> pp 2 x dp_shard 2 x cp 2, ep 2
    recipes/glm5*/lora_4k.yaml      dp_shard 128, ep 128, LoRA                  -> dp_shard 2, ep 2, LoRA

GLM-5.2/5.3's recipes are GLM-5's with another model; the tiny model has their shared-indexer
layers. The FP8 one-node LoRA recipe's layout (dp_shard 8, ep 8 over an FP8 base) is the one of
tests/distributed/test_fp8_base_sharded.py at ep 2. The runs are `glmtune train` through the CLI's
entry point in processes forked with torch and glmtune imported (tests/distributed/forked_runs.py),
as torchrun starts its ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.config import load_config
from glmtune.config.loader import RECIPES_DIR
from glmtune.preflight.layout import ONE_PROCESS, UNPINNED_TOPOLOGY, scaled_replica
from tests.distributed.forked_cli import commands_in_forks

# What makes a 256-GPU recipe a CPU-sized one; everything else stays as the recipe says.
TINY = [
    "--model.name_or_path", "tiny", "--model.validate_as", "null", "--model.dtype", "float32",
    "--train.device", "cpu", "--data.train", "[]", "--data.synthetic.rows", "240",
    "--data.packed_sequence_size", "256", "--data.too_long", "drop", *UNPINNED_TOPOLOGY, "--train.max_steps", "4",
    "--checkpoint.every_steps", "2", "--checkpoint.export_hf", "false", "--train.val_every", "0",
    "--logging.progress", "false", "--logging.tensorboard", "false", "--train.log_every", "1",
]


def _train(nproc: int, recipe: Path, run_dir: Path, cache: Path, *extra: str) -> None:
    commands_in_forks({run_dir: ["train", str(recipe), *TINY, "--logging.run_dir", str(run_dir),
                                 "--data.cache_dir", str(cache), *extra]}, nproc)


def _records(run_dir: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}


@pytest.mark.parametrize("name", ["sft_4k", "sft_32k_cp8", "lora_4k"])
def test_scaled_down_glm5_topology_equals_one_process(name, tmp_path):
    recipe = RECIPES_DIR / "glm5" / f"{name}.yaml"
    replica = scaled_replica(load_config(recipe).parallel)  # the recipe's axes at 2, 2 data-parallel ranks
    # sft_32k_cp8's absorbed_triton runs on a GPU: on the CPU, its torch reference (the same attention form).
    form = ["--model.attention_backend", "absorbed"] if name == "sft_32k_cp8" else []
    _train(1, recipe, tmp_path / "single", tmp_path / "cache", *replica.batch, *ONE_PROCESS, *form)
    _train(replica.world, recipe, tmp_path / "replica", tmp_path / "cache", *replica.batch, *replica.layout, *form)
    expected, actual = _records(tmp_path / "single"), _records(tmp_path / "replica")
    assert sorted(actual) == [1, 2, 3, 4]
    for step, (loss, norm) in expected.items():
        assert actual[step][0] == pytest.approx(loss, rel=1e-5), step
        assert actual[step][1] == pytest.approx(norm, rel=1e-5), step
